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
form's. `weight_matmul_kernel` is what the model is given: one call for both ops.
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


@CustomOp.register(library=KILN_LIBRARY)
class scaled_weight_matmul(CustomOp):
    """x [B, M, K] @ w [B, N, K]^T, int8, as float32 times w_scale [B, 1, N]."""

    signature = "scaled_weight_matmul(Tensor x, Tensor w, Tensor w_scale) -> Tensor"

    def select(self, ksel: KernelSelection):
        x, w, w_scale = (ksel.arg_tensor(i) for i in range(3))
        torch._check(x.t.dtype == w.t.dtype == torch.int8 and x.t.dim() == w.t.dim() == 3,
                     lambda: f"scaled_weight_matmul: int8 batches x [B, M, K] and w [B, N, K], got {x.t.dtype}, {w.t.dtype}")
        torch._check(w_scale.t.dtype == torch.float32, lambda: "scaled_weight_matmul: float32 scales")
        for arg in (x, w, w_scale):
            arg.specialize_dims(*static_dims(arg))
        result = ksel.return_new_tensor([x.t.shape[0], x.t.shape[1], w.t.shape[1]], torch.float32)
        result.specialize_dims(*static_dims(result))

    def eager_execute(self, x, w, w_scale):
        return eager_weight_matmul(x, w, w_scale)

    def generate(self, ksel: KernelSelection, kb: KernelBuilder):
        x, w, w_scale = kb.arg_bindings
        x_type, w_type, ws_type = (ir.RankedTensorType(arg.type) for arg in (x, w, w_scale))
        dynamic = ir.ShapedType.get_dynamic_size()
        torch._check(dynamic not in (*x_type.shape, *w_type.shape), lambda: "scaled_weight_matmul: static shapes only")
        b, m, n = x_type.shape[0], x_type.shape[1], w_type.shape[1]
        sums_type = f"tensor<{b}x{m}x{n}xi32>"
        out_type = f"tensor<{b}x{m}x{n}xf32>"
        name = f"kiln_scaled_weight_matmul_{type_ident(x_type, w_type)}"
        text = f"""module {{
util.func private @{name}(%x: {x_type}, %w: {w_type}, %ws: {ws_type}) -> {out_type} {{
  %empty = tensor.empty() : {sums_type}
  %zero = arith.constant 0 : i32
  %acc = linalg.fill ins(%zero : i32) outs(%empty : {sums_type}) -> {sums_type}
  %sums = linalg.batch_matmul indexing_maps = [affine_map<(b, m, n, k) -> (b, m, k)>,
      affine_map<(b, m, n, k) -> (b, n, k)>, affine_map<(b, m, n, k) -> (b, m, n)>]
      ins(%x, %w : {x_type}, {w_type}) outs(%acc : {sums_type}) -> {sums_type}
  %out_empty = tensor.empty() : {out_type}
  %scaled = linalg.generic {{indexing_maps = [affine_map<(b, m, n) -> (b, m, n)>,
      affine_map<(b, m, n) -> (b, 0, n)>, affine_map<(b, m, n) -> (b, m, n)>],
      iterator_types = ["parallel", "parallel", "parallel"]}}
      ins(%sums, %ws : {sums_type}, {ws_type}) outs(%out_empty : {out_type}) {{
  ^bb0(%s: i32, %c: f32, %o: f32):
    %f = arith.sitofp %s : i32 to f32
    %q = arith.mulf %f, %c : f32
    linalg.yield %q : f32
  }} -> {out_type}
  util.return %scaled : {out_type}
}}
}}"""
        emit_function(kb, name, text)


def weight_matmul_kernel(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None = None) -> torch.Tensor:
    """`eager_weight_matmul`'s contract, as the export's custom ops."""
    return weight_matmul(x, w) if w_scale is None else scaled_weight_matmul(x, w, w_scale)
