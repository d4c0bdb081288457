"""A weight matmul whose inputs are narrower than its result, as one IREE op.

`x @ w^T` with x [M, K] and w [N, K] (or a batch of them, [B, M, K] and [B, N, K]), both
bfloat16 (result float32) or both int8 (result int32): a `linalg.matmul` (`batch_matmul`)
with those element types is what IREE's data tiling turns into its mixed-precision mmt4d
kernels on llvm-cpu (AVX512-BF16 dot products; VNNI for int8). Torch cannot express it (its
bf16 and int8 matmuls return their input type), so the export emits it through an
iree-turbine custom op. Eager torch runs the same arithmetic in wider types, the model's own
default (models/quantize.py).

`scaled_weight_matmul` is the int8 batch form with each sum scaled by its column's scale (a
Q8_0 block's), in the matmul's own dispatch: the caller's sum over the blocks is then the int8
form's. `offset_weight_matmul` also adds each block's input sum times its column's offset (a
Q4_1 or Q4_K block's minimum) there. `weight_matmul_kernel` is what the model is given: one
call for all three.
"""

from __future__ import annotations

import torch
from iree.compiler import ir
from iree.turbine.runtime.op_reg import CustomOp, KernelBuilder, KernelSelection

from kiln.models.quantize import eager_weight_matmul

from .custom_ops import KILN_LIBRARY, emit_function, static_dims, type_ident

_RESULT = {torch.bfloat16: torch.float32, torch.int8: torch.int32}


@CustomOp.register(library=KILN_LIBRARY)
class weight_matmul(CustomOp):
    """x [..., M, K] @ w [..., N, K]^T -> [..., M, N]: bf16 inputs give float32, int8 inputs int32."""

    signature = "weight_matmul(Tensor x, Tensor w) -> Tensor"

    def select(self, ksel: KernelSelection):
        x = ksel.arg_tensor(0)
        w = ksel.arg_tensor(1)
        torch._check(x.t.dtype == w.t.dtype and x.t.dtype in _RESULT,
                     lambda: f"weight_matmul: bf16 or int8 inputs of one type, got {x.t.dtype} and {w.t.dtype}")
        torch._check(x.t.dim() == w.t.dim() and x.t.dim() in (2, 3),
                     lambda: "weight_matmul: x [M, K] and w [N, K], or batches of them")
        x.specialize_dims(*static_dims(x))
        w.specialize_dims(*range(w.t.dim()))
        result = ksel.return_new_tensor([*x.t.shape[:-1], w.t.shape[-2]], _RESULT[x.t.dtype])
        result.specialize_dims(*static_dims(result))

    def eager_execute(self, x, w):
        return eager_weight_matmul(x, w)

    def generate(self, ksel: KernelSelection, kb: KernelBuilder):
        x, w = kb.arg_bindings
        x_type, w_type = ir.RankedTensorType(x.type), ir.RankedTensorType(w.type)
        integer = ir.IntegerType.isinstance(x_type.element_type)
        acc = "i32" if integer else "f32"
        zero = "0" if integer else "0.0"
        # The result's dims are x's but the last, then w's rows; x's dynamic ones are read off x.
        out_dims = [*x_type.shape[:-1], w_type.shape[-2]]
        dim_lines, dim_names = [], []
        for axis, size in enumerate(out_dims):
            if size == ir.ShapedType.get_dynamic_size():
                dim_lines.append(f"%c{axis} = arith.constant {axis} : index")
                dim_lines.append(f"%d{axis} = tensor.dim %x, %c{axis} : {x_type}")
                dim_names.append(f"%d{axis}")
        out_type = ir.RankedTensorType.get(out_dims, ir.IntegerType.get_signless(32) if integer else ir.F32Type.get())
        if x_type.rank == 2:
            op, maps = "linalg.matmul", "(m, n, k) -> (m, k)>, affine_map<(m, n, k) -> (n, k)>, affine_map<(m, n, k) -> (m, n)"
        else:
            op, maps = ("linalg.batch_matmul", "(b, m, n, k) -> (b, m, k)>, affine_map<(b, m, n, k) -> (b, n, k)>, "
                        "affine_map<(b, m, n, k) -> (b, m, n)")
        name = f"kiln_weight_matmul_{type_ident(x_type, w_type)}"
        text = f"""module {{
util.func private @{name}(%x: {x_type}, %w: {w_type}) -> {out_type} {{
  {chr(10).join(dim_lines)}
  %empty = tensor.empty({", ".join(dim_names)}) : {out_type}
  %zero = arith.constant {zero} : {acc}
  %acc = linalg.fill ins(%zero : {acc}) outs(%empty : {out_type}) -> {out_type}
  %out = {op} indexing_maps = [affine_map<{maps}>]
      ins(%x, %w : {x_type}, {w_type}) outs(%acc : {out_type}) -> {out_type}
  util.return %out : {out_type}
}}
}}"""
        emit_function(kb, name, text)


def _scaled_text(name: str, x_type, w_type, ws_type, offset_types=None) -> str:
    """An int8 batch matmul whose sums become float32 times their column's scale, plus, with
    `offset_types` (x_sum [B, M, 1], w_offset [B, 1, N]), x_sum times the column's offset: one
    dispatch's epilogue either way."""
    dynamic = ir.ShapedType.get_dynamic_size()
    torch._check(dynamic not in (*x_type.shape, *w_type.shape), lambda: f"{name}: static shapes only")
    b, m, n = x_type.shape[0], x_type.shape[1], w_type.shape[1]
    sums_type = f"tensor<{b}x{m}x{n}xi32>"
    out_type = f"tensor<{b}x{m}x{n}xf32>"
    args, ins, maps, block_args, epilogue = "", "%sums, %ws", "", "", ""
    in_types = f"{sums_type}, {ws_type}"
    if offset_types is not None:
        xs_type, wo_type = offset_types
        args = f", %xs: {xs_type}, %wo: {wo_type}"
        ins += ", %xs, %wo"
        in_types += f", {xs_type}, {wo_type}"
        maps = "affine_map<(b, m, n) -> (b, m, 0)>, affine_map<(b, m, n) -> (b, 0, n)>, "
        block_args = ", %xsum: f32, %off: f32"
        epilogue = """
    %t = arith.mulf %xsum, %off : f32
    %r = arith.addf %q, %t : f32"""
    result = "%r" if offset_types is not None else "%q"
    return f"""module {{
util.func private @{name}(%x: {x_type}, %w: {w_type}, %ws: {ws_type}{args}) -> {out_type} {{
  %empty = tensor.empty() : {sums_type}
  %zero = arith.constant 0 : i32
  %acc = linalg.fill ins(%zero : i32) outs(%empty : {sums_type}) -> {sums_type}
  %sums = linalg.batch_matmul indexing_maps = [affine_map<(b, m, n, k) -> (b, m, k)>,
      affine_map<(b, m, n, k) -> (b, n, k)>, affine_map<(b, m, n, k) -> (b, m, n)>]
      ins(%x, %w : {x_type}, {w_type}) outs(%acc : {sums_type}) -> {sums_type}
  %out_empty = tensor.empty() : {out_type}
  %scaled = linalg.generic {{indexing_maps = [affine_map<(b, m, n) -> (b, m, n)>,
      affine_map<(b, m, n) -> (b, 0, n)>, {maps}affine_map<(b, m, n) -> (b, m, n)>],
      iterator_types = ["parallel", "parallel", "parallel"]}}
      ins({ins} : {in_types}) outs(%out_empty : {out_type}) {{
  ^bb0(%s: i32, %c: f32{block_args}, %o: f32):
    %f = arith.sitofp %s : i32 to f32
    %q = arith.mulf %f, %c : f32{epilogue}
    linalg.yield {result} : f32
  }} -> {out_type}
  util.return %scaled : {out_type}
}}
}}"""


def _check_int8_batches(op: str, x, w, *float_args) -> None:
    torch._check(x.t.dtype == w.t.dtype == torch.int8 and x.t.dim() == w.t.dim() == 3,
                 lambda: f"{op}: int8 batches x [B, M, K] and w [B, N, K], got {x.t.dtype}, {w.t.dtype}")
    torch._check(all(a.t.dtype == torch.float32 for a in float_args), lambda: f"{op}: float32 scales and offsets")


@CustomOp.register(library=KILN_LIBRARY)
class scaled_weight_matmul(CustomOp):
    """x [B, M, K] @ w [B, N, K]^T, int8, as float32 times w_scale [B, 1, N]."""

    signature = "scaled_weight_matmul(Tensor x, Tensor w, Tensor w_scale) -> Tensor"

    def select(self, ksel: KernelSelection):
        x, w, w_scale = (ksel.arg_tensor(i) for i in range(3))
        _check_int8_batches("scaled_weight_matmul", x, w, w_scale)
        for arg in (x, w, w_scale):
            arg.specialize_dims(*static_dims(arg))
        result = ksel.return_new_tensor([x.t.shape[0], x.t.shape[1], w.t.shape[1]], torch.float32)
        result.specialize_dims(*static_dims(result))

    def eager_execute(self, x, w, w_scale):
        return eager_weight_matmul(x, w, w_scale)

    def generate(self, ksel: KernelSelection, kb: KernelBuilder):
        x_type, w_type, ws_type = (ir.RankedTensorType(arg.type) for arg in kb.arg_bindings)
        name = f"kiln_scaled_weight_matmul_{type_ident(x_type, w_type)}"
        emit_function(kb, name, _scaled_text(name, x_type, w_type, ws_type))


@CustomOp.register(library=KILN_LIBRARY)
class offset_weight_matmul(CustomOp):
    """scaled_weight_matmul plus x_sum [B, M, 1] times w_offset [B, 1, N]: a block type with a
    minimum (Q4_1, Q4_K), each block's input sum times its offset in the same dispatch."""

    signature = "offset_weight_matmul(Tensor x, Tensor w, Tensor w_scale, Tensor x_sum, Tensor w_offset) -> Tensor"

    def select(self, ksel: KernelSelection):
        x, w, w_scale, x_sum, w_offset = (ksel.arg_tensor(i) for i in range(5))
        _check_int8_batches("offset_weight_matmul", x, w, w_scale, x_sum, w_offset)
        for arg in (x, w, w_scale, x_sum, w_offset):
            arg.specialize_dims(*static_dims(arg))
        result = ksel.return_new_tensor([x.t.shape[0], x.t.shape[1], w.t.shape[1]], torch.float32)
        result.specialize_dims(*static_dims(result))

    def eager_execute(self, x, w, w_scale, x_sum, w_offset):
        return eager_weight_matmul(x, w, w_scale, x_sum, w_offset)

    def generate(self, ksel: KernelSelection, kb: KernelBuilder):
        x_type, w_type, ws_type, xs_type, wo_type = (ir.RankedTensorType(arg.type) for arg in kb.arg_bindings)
        name = f"kiln_offset_weight_matmul_{type_ident(x_type, w_type)}"
        emit_function(kb, name, _scaled_text(name, x_type, w_type, ws_type, (xs_type, wo_type)))


def weight_matmul_kernel(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None = None,
                         x_sum: torch.Tensor | None = None, w_offset: torch.Tensor | None = None) -> torch.Tensor:
    """`eager_weight_matmul`'s contract, as the export's custom ops."""
    if w_scale is None:
        return weight_matmul(x, w)
    if w_offset is None:
        return scaled_weight_matmul(x, w, w_scale)
    return offset_weight_matmul(x, w, w_scale, x_sum, w_offset)
