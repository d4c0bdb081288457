"""Gathering KV pages by index as IREE's own gather op.

Torch indexing (`pages[index]`, `index_select`, `embedding`) reaches IREE 3.13 as a
`linalg.generic` that does a `tensor.extract` per element; on llvm-cpu it copies ~7-10 GB/s
and was half of a decode step. `iree_linalg_ext.gather` copies whole pages and ran 1.6-4.6x
faster in a one-dispatch probe (benchmarks/NOTES.md), so the export hands this op to the
model (PagedLlama's `gather_pages`) and it is emitted directly through an iree-turbine
custom op. Eager torch runs plain indexing, the model's own default.
"""

from __future__ import annotations

import torch
from iree.compiler import ir
from iree.turbine.runtime.op_reg import CustomOp, KernelBuilder, KernelSelection

from .custom_ops import KILN_LIBRARY, emit_function, static_dims, type_ident


@CustomOp.register(library=KILN_LIBRARY)
class gather_pages(CustomOp):
    """`pages[index]`: pages [P, ...], integer index [...] -> [*index.shape, *pages.shape[1:]]."""

    signature = "gather_pages(Tensor pages, Tensor index) -> Tensor"

    def select(self, ksel: KernelSelection):
        pages = ksel.arg_tensor(0)
        index = ksel.arg_tensor(1)
        torch._check(index.t.dtype in (torch.int32, torch.int64), lambda: "gather_pages: integer index")
        pages.specialize_dims(*static_dims(pages))
        index.specialize_dims(*static_dims(index))
        result = ksel.return_new_tensor([*index.t.shape, *pages.t.shape[1:]], pages.t.dtype)
        result.specialize_dims(*static_dims(result))

    def eager_execute(self, pages, index):
        return pages[index]

    def generate(self, ksel: KernelSelection, kb: KernelBuilder):
        pages, index = kb.arg_bindings
        pages_type = ir.RankedTensorType(pages.type)
        index_type = ir.RankedTensorType(index.type)
        out_shape = [*index_type.shape, *pages_type.shape[1:]]
        out_type = ir.RankedTensorType.get(out_shape, pages_type.element_type)
        # The sizes of the result's dynamic dims: each is a dim of the index or of a page.
        sources = [("%index", index_type, i) for i in range(index_type.rank)]
        sources += [("%pages", pages_type, i) for i in range(1, pages_type.rank)]
        dim_lines, dim_names = [], []
        for position, (value, value_type, axis) in enumerate(sources):
            if out_shape[position] == ir.ShapedType.get_dynamic_size():
                dim_lines.append(f"%c{position} = arith.constant {axis} : index")
                dim_lines.append(f"%d{position} = tensor.dim {value}, %c{position} : {value_type}")
                dim_names.append(f"%d{position}")
        name = f"kiln_gather_pages_{type_ident(pages_type, index_type)}"
        text = f"""module {{
util.func private @{name}(%pages: {pages_type}, %index: {index_type}) -> {out_type} {{
  {chr(10).join(dim_lines)}
  %empty = tensor.empty({", ".join(dim_names)}) : {out_type}
  %out = iree_linalg_ext.gather dimension_map = [0] ins(%pages, %index : {pages_type}, {index_type}) outs(%empty : {out_type}) -> {out_type}
  util.return %out : {out_type}
}}
}}"""
        emit_function(kb, name, text)
