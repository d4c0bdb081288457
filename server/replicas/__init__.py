"""Data-parallel serving on Ray Serve: N engine replicas, each a whole Kiln app with its own
KV cache, behind one front whose router sends a request to the replica that already holds
its prefix. Ray is the `ray` extra, imported only by `kiln serve --data-parallel`.
"""
