"""LoRA adapters applied per row through the hand-written CPU kernel (`kiln_lora_delta` in
cpu_kernels.c): each row's adapter weights read where they lie in the stacked arguments.

The model's own form (models/lora.py's LoraLinear) gathers every row's A and B out of the stacked
slots into a copy, then runs two batch matmuls: at 8 slots of rank 16 over every projection of
SmolLM2, 147 MB of copies a decode step at batch 8, whatever the rows' adapters, which cut the
step's speed to a third. The kernel reads a row's slot in place, and a row with no adapter reads
nothing: punica's BGMV, on the CPU. An export with the CPU kernels hands it to the adapted layers
(`attach_lora`'s `delta_kernel`); eager torch runs the model's own arithmetic.
"""

from __future__ import annotations

import torch
from iree.compiler import ir
from iree.turbine.runtime.op_reg import CustomOp, KernelBuilder, KernelSelection

from kiln.models.lora import gathered_delta

from .cpu_kernels import executable_header
from .custom_ops import KILN_LIBRARY, emit_function

# The kernel's limits (cpu_kernels.c's LORA_*): features in whole vectors of 16, ranks it holds.
FEATURES_PER_VECTOR = 16
MAX_RANK = 256
TOKENS_PER_WORKGROUP = 16


def supports(features: list[tuple[int, int]], rank: int) -> bool:
    """Whether the kernel serves adapters of up to `rank` on layers of these (in, out) features."""
    return rank <= MAX_RANK and all(f % FEATURES_PER_VECTOR == 0 for pair in features for f in pair)


def _lora_delta_text(name: str, rows: int, fin: int, fout: int, a_shape: list[int], b_shape: list[int],
                     layer: int) -> str:
    """A module holding the kernel's executable and `name`, which dispatches it on x [rows, ?, fin],
    the stacked A [layers, slots, rank, fin] and B^T [layers, slots, rank, fout] (whole), and the
    rows' slots [rows], for the delta [rows, ?, fout] of layer `layer`."""
    f32, i64 = "memref<?xf32>", "memref<?xi64>"
    layers, slot_count, rank, _ = a_shape
    x_type, y_type = f"tensor<{rows}x?x{fin}xf32>", f"tensor<{rows}x?x{fout}xf32>"
    a_type, b_type = f"tensor<{'x'.join(map(str, a_shape))}xf32>", f"tensor<{'x'.join(map(str, b_shape))}xf32>"
    a_elems, b_elems = layers * slot_count * rank * fin, layers * slot_count * rank * fout
    return f"""module {{
{executable_header(name, "lora_delta", per_workgroup=1)}
  builtin.module {{
    func.func private @kiln_lora_delta({f32}, {f32}, {f32}, {i64}, {f32}, index, index, index, index, index, index,
                                       index) attributes {{hal.import.static}}
    func.func @lora_delta(%x_binding: !stream.binding, %a_binding: !stream.binding, %b_binding: !stream.binding,
                          %slots_binding: !stream.binding, %y_binding: !stream.binding, %rows: index,
                          %tokens: index, %in: index, %out: index, %rank: index, %slot_count: index,
                          %layer: index, %a_size: index, %b_size: index) {{
      %c0 = arith.constant 0 : index
      %workgroup = stream.dispatch.workgroup.id[0] : index
      %row_tokens = arith.muli %rows, %tokens : index
      %x_size = arith.muli %row_tokens, %in : index
      %y_size = arith.muli %row_tokens, %out : index
      %x = stream.binding.subspan %x_binding[%c0] : !stream.binding -> {f32}{{%x_size}}
      %a = stream.binding.subspan %a_binding[%c0] : !stream.binding -> {f32}{{%a_size}}
      %b = stream.binding.subspan %b_binding[%c0] : !stream.binding -> {f32}{{%b_size}}
      %slots = stream.binding.subspan %slots_binding[%c0] : !stream.binding -> {i64}{{%rows}}
      %y = stream.binding.subspan %y_binding[%c0] : !stream.binding -> {f32}{{%y_size}}
      func.call @kiln_lora_delta(%x, %a, %b, %slots, %y, %tokens, %in, %out, %rank, %slot_count, %layer, %workgroup)
          : ({f32}, {f32}, {f32}, {i64}, {f32}, index, index, index, index, index, index, index) -> ()
      return
    }}
  }}
}}
util.func private @{name}(%x: {x_type}, %a: {a_type}, %b: {b_type}, %slots: tensor<{rows}xi64>) -> {y_type} {{
  %c1 = arith.constant 1 : index
  %c{TOKENS_PER_WORKGROUP - 1} = arith.constant {TOKENS_PER_WORKGROUP - 1} : index
  %c{TOKENS_PER_WORKGROUP} = arith.constant {TOKENS_PER_WORKGROUP} : index
  %rows = arith.constant {rows} : index
  %in = arith.constant {fin} : index
  %out = arith.constant {fout} : index
  %rank = arith.constant {rank} : index
  %slot_count = arith.constant {slot_count} : index
  %layer = arith.constant {layer} : index
  %a_size = arith.constant {a_elems} : index
  %b_size = arith.constant {b_elems} : index
  %tokens = tensor.dim %x, %c1 : {x_type}
  %padded = arith.addi %tokens, %c{TOKENS_PER_WORKGROUP - 1} : index
  %chunks = arith.divui %padded, %c{TOKENS_PER_WORKGROUP} : index
  %workgroups = arith.muli %rows, %chunks : index
  %row_tokens = arith.muli %rows, %tokens : index
  %x_size = arith.muli %row_tokens, %in : index
  %y_size = arith.muli %row_tokens, %out : index
  %x_flat = tensor.collapse_shape %x [[0, 1, 2]] : {x_type} into tensor<?xf32>
  %a_flat = tensor.collapse_shape %a [[0, 1, 2, 3]] : {a_type} into tensor<{a_elems}xf32>
  %b_flat = tensor.collapse_shape %b [[0, 1, 2, 3]] : {b_type} into tensor<{b_elems}xf32>
  %y_flat = flow.dispatch @{name}_executable::@lora_delta[%workgroups](%x_flat, %a_flat, %b_flat, %slots, %rows,
      %tokens, %in, %out, %rank, %slot_count, %layer, %a_size, %b_size)
      : (tensor<?xf32>{{%x_size}}, tensor<{a_elems}xf32>, tensor<{b_elems}xf32>, tensor<{rows}xi64>, index, index,
         index, index, index, index, index, index, index) -> tensor<?xf32>{{%y_size}}
  %y = tensor.expand_shape %y_flat [[0, 1, 2]] output_shape [{rows}, %tokens, {fout}] : tensor<?xf32> into {y_type}
  util.return %y : {y_type}
}}
}}"""


@CustomOp.register(library=KILN_LIBRARY)
class lora_delta(CustomOp):
    """x [N, T, in] float32 through each row's adapter (slots [N] int64, 0 for none) of layer
    `layer`: A [layers, slots + 1, rank, in] and B^T [layers, slots + 1, rank, out], the stacked
    arguments whole -> float32 [N, T, out]."""

    signature = "lora_delta(Tensor x, Tensor a, Tensor b, Tensor slots, int layer) -> Tensor"

    def select(self, ksel: KernelSelection):
        x, a, b, slots = (ksel.arg_tensor(i) for i in range(4))
        ksel.attr_int(4)
        torch._check(x.t.dtype == a.t.dtype == b.t.dtype == torch.float32 and x.t.dim() == 3 and a.t.dim() == 4
                     and b.t.dim() == 4, lambda: "lora_delta: float32 x [N, T, in], A and B^T [layers, slots, rank, _]")
        torch._check(slots.t.dtype == torch.int64 and slots.t.dim() == 1, lambda: "lora_delta: int64 slots [N]")
        x.specialize_dims(0, 2)
        a.specialize_all_dims()
        b.specialize_all_dims()
        slots.specialize_all_dims()
        out = ksel.return_new_tensor([x.t.shape[0], x.t.shape[1], b.t.shape[3]], torch.float32)
        out.specialize_dims(0, 2)

    def eager_execute(self, x, a, b, slots, layer):
        return gathered_delta(x, a[layer], b[layer], slots)

    def generate(self, ksel: KernelSelection, kb: KernelBuilder):
        x_type = ir.RankedTensorType(kb.arg_bindings[0].type)
        a_shape = list(ir.RankedTensorType(kb.arg_bindings[1].type).shape)
        b_shape = list(ir.RankedTensorType(kb.arg_bindings[2].type).shape)
        rows, fin, fout, layer = x_type.shape[0], x_type.shape[2], b_shape[3], ksel.arg_descs[4].v
        name = f"kiln_lora_delta_{rows}x{fin}x{fout}_{'x'.join(map(str, a_shape[:3]))}_l{layer}"
        emit_function(kb, name, _lora_delta_text(name, rows, fin, fout, a_shape, b_shape, layer))
