"""Generation for diffusion LMs (LLaDA, Dream): a canvas of mask tokens filled in over forward passes.

`params` holds what a request may ask, `commit` the numpy rules that choose which masked
positions a pass commits, `canvas` one sequence's progress and the window its next pass
computes, `scheduler` which canvases share the next `denoise` call.
"""
