"""Decode attention that reads the KV cache's pages where they lie, through the hand-written CPU
kernel (`kiln_paged_decode_attention` in cpu_kernels.c).

The model's own decode attention gathers every page of every sequence into a contiguous copy and
runs batch matmuls and a blocked softmax over it (models/llama.py, `CachePages`): about ten
dispatches a layer and a copy that grows with the batch and the context. An export with the CPU
kernels hands the model this op instead (PagedLlama's `decode_attention`): one dispatch a layer,
a workgroup per (sequence, K/V head) walking its block table. IREE's own code for an indexed read
inside a contraction did not beat the copy (benchmarks/NOTES.md, "Attention reading pages in
place"), so the loop is written by hand, as the one-row matmuls are. Eager torch runs the same
arithmetic through the gather.
"""

from __future__ import annotations

import torch
from iree.compiler import ir
from iree.turbine.runtime.op_reg import CustomOp, KernelBuilder, KernelSelection

from kiln.models import kv_quant
from kiln.models.config import LlamaConfig
from kiln.runtime.config import KV_SCALE_BYTES

from .cpu_kernels import executable_header
from .custom_ops import KILN_LIBRARY, emit_function

# The kernel reads 16 keys a vector (a page holds a whole number of them) and keeps a group's
# running sums in registers and on its stack (cpu_kernels.c's ATTENTION_* limits).
KEYS_PER_VECTOR = 16
MAX_GROUP = 16
MAX_HEAD_DIM = 256
# cpu_kernels.c's entry points: the float32 cache's, and each byte format's.
FLOAT_KERNEL_SYMBOL = "kiln_paged_decode_attention"
BYTE_KERNEL_SYMBOLS = {"int8": "kiln_paged_decode_attention_i8", "fp8_e4m3": "kiln_paged_decode_attention_fp8"}


def supports(config: LlamaConfig, block_seq_stride: int, cache_dtype: str) -> bool:
    """Whether the kernel serves this model's decode attention: a float32 or byte cache, pages of
    whole vectors of keys, a head of whole vectors of channels, and a query group the kernel holds."""
    group = config.num_attention_heads // config.num_key_value_heads
    return (cache_dtype in KERNELS and block_seq_stride % KEYS_PER_VECTOR == 0
            and config.head_dim % KEYS_PER_VECTOR == 0 and config.head_dim <= MAX_HEAD_DIM
            and 1 <= group <= MAX_GROUP and not config.is_diffusion)


def eager_decode_attention(q, key_pages, pages, visible, value_pages=None):
    """The kernel's arithmetic in torch: q [N, H, D] (scaled) against the first visible[n] keys of
    row n's pages (K page `pages[n, h, b]` of key_pages [X, D, stride], its V page kv_heads later
    in value_pages [X, stride, D], by default the same buffer), softmax, times V: [N, H, D]; 0 for
    a row that sees no key."""
    n, heads, head_dim = q.shape
    kv_heads, blocks = pages.shape[1], pages.shape[2]
    stride = key_pages.shape[2]
    value_pages = key_pages.view(-1, stride, head_dim) if value_pages is None else value_pages
    keys_t = key_pages[pages].permute(0, 1, 3, 2, 4).reshape(n, kv_heads, head_dim, blocks * stride)
    values = value_pages[pages + kv_heads].reshape(n, kv_heads, blocks * stride, head_dim)
    scores = q.view(n, kv_heads, heads // kv_heads, head_dim) @ keys_t
    seen = torch.arange(blocks * stride).view(1, 1, 1, -1) < visible.view(n, 1, 1, 1)
    weights = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1).nan_to_num(0.0)
    return (weights @ values).reshape(n, heads, head_dim)


def dequantized_pages(key_pages: torch.Tensor, page_blocks: int, value_blocks: int, fmt: str = "int8"):
    """A byte cache's blocks (key_pages [X, D, stride], int8 bytes of format `fmt`, pages of
    `page_blocks` blocks whose first `value_blocks` are K and V blocks, the rest their scales) as
    float32 K pages [X, D, stride] and V pages [X, stride, D], every value block read both ways; a
    scale block's are 0."""
    count, head_dim, stride = key_pages.shape
    block = torch.arange(count)
    page, local = block // page_blocks, block % page_blocks
    rows = key_pages.reshape(-1, KV_SCALE_BYTES * stride)
    row = (page * page_blocks + value_blocks) * (head_dim // KV_SCALE_BYTES) + local.clamp(max=value_blocks - 1)
    scales = kv_quant.scales(rows[row].view(count, stride, KV_SCALE_BYTES)) * (local < value_blocks).view(-1, 1)
    values = kv_quant.values(key_pages, fmt)
    return values * scales.unsqueeze(1), values.view(count, stride, head_dim) * scales.unsqueeze(-1)


def _decode_attention_text(name: str, rows: int, heads: int, kv_heads: int, head_dim: int, stride: int,
                           byte_page: tuple[int, int] | None = None, kernel: str = FLOAT_KERNEL_SYMBOL) -> str:
    """A module holding the kernel's executable and `name`, which dispatches `kernel` on q [rows, heads,
    head_dim], the cache's K pages [?, head_dim, stride] (the whole buffer: float32, or bytes whose
    pages hold `byte_page` = (blocks a page, of them value blocks)), the page table [rows,
    kv_heads, ?] and the visible key counts [rows], for the output [rows, heads, head_dim]. Every
    size reaches the kernel as an operand, so the executables of all shapes have one body."""
    element = "f32" if byte_page is None else "i8"
    f32, i64, cache_memref = "memref<?xf32>", "memref<?xi64>", f"memref<?x{element}>"
    q_elems = rows * heads * head_dim
    pages_type, table_type = f"tensor<?x{head_dim}x{stride}x{element}>", f"tensor<{rows}x{kv_heads}x?xi64>"
    q_type = f"tensor<{rows}x{heads}x{head_dim}xf32>"
    # A byte cache's page shape: two more operands, before the workgroup.
    extra = [] if byte_page is None else ["%page_blocks", "%value_blocks"]
    extra_params = "".join(f", {e}: index" for e in extra)
    extra_args = "".join(f", {e}" for e in extra)
    extra_types = ", index" * len(extra)
    extra_constants = "".join(f"\n  {e} = arith.constant {v} : index" for e, v in zip(extra, byte_page or ()))
    return f"""module {{
{executable_header(name, "paged_decode_attention", per_workgroup=1)}
  builtin.module {{
    func.func private @{kernel}({f32}, {cache_memref}, {i64}, {i64}, {f32}, index, index, index, index,
                                index{extra_types}, index) attributes {{hal.import.static}}
    func.func @paged_decode_attention(%q_binding: !stream.binding, %cache_binding: !stream.binding,
                                      %pages_binding: !stream.binding, %visible_binding: !stream.binding,
                                      %out_binding: !stream.binding, %rows: index, %heads: index, %kv_heads: index,
                                      %head_dim: index, %stride: index, %blocks: index{extra_params},
                                      %cache_size: index) {{
      %c0 = arith.constant 0 : index
      %workgroup = stream.dispatch.workgroup.id[0] : index
      %rows_heads = arith.muli %rows, %heads : index
      %q_size = arith.muli %rows_heads, %head_dim : index
      %table_rows = arith.muli %rows, %kv_heads : index
      %table_size = arith.muli %table_rows, %blocks : index
      %q = stream.binding.subspan %q_binding[%c0] : !stream.binding -> {f32}{{%q_size}}
      %cache = stream.binding.subspan %cache_binding[%c0] : !stream.binding -> {cache_memref}{{%cache_size}}
      %pages = stream.binding.subspan %pages_binding[%c0] : !stream.binding -> {i64}{{%table_size}}
      %visible = stream.binding.subspan %visible_binding[%c0] : !stream.binding -> {i64}{{%rows}}
      %out = stream.binding.subspan %out_binding[%c0] : !stream.binding -> {f32}{{%q_size}}
      func.call @{kernel}(%q, %cache, %pages, %visible, %out, %heads, %kv_heads, %head_dim, %stride, %blocks
                          {extra_args}, %workgroup)
          : ({f32}, {cache_memref}, {i64}, {i64}, {f32}, index, index, index, index, index{extra_types}, index) -> ()
      return
    }}
  }}
}}
util.func private @{name}(%q: {q_type}, %key_pages: {pages_type}, %pages: {table_type},
                          %visible: tensor<{rows}xi64>) -> {q_type} {{
  %c0 = arith.constant 0 : index
  %c2 = arith.constant 2 : index
  %rows = arith.constant {rows} : index
  %heads = arith.constant {heads} : index
  %kv_heads = arith.constant {kv_heads} : index
  %head_dim = arith.constant {head_dim} : index
  %stride = arith.constant {stride} : index{extra_constants}
  %workgroups = arith.constant {rows * kv_heads} : index
  %page_count = tensor.dim %key_pages, %c0 : {pages_type}
  %blocks = tensor.dim %pages, %c2 : {table_type}
  %page_elems = arith.constant {head_dim * stride} : index
  %cache_size = arith.muli %page_count, %page_elems : index
  %table_size = arith.muli %blocks, %workgroups : index
  %q_flat = tensor.collapse_shape %q [[0, 1, 2]] : {q_type} into tensor<{q_elems}xf32>
  %cache = tensor.collapse_shape %key_pages [[0, 1, 2]] : {pages_type} into tensor<?x{element}>
  %table = tensor.collapse_shape %pages [[0, 1, 2]] : {table_type} into tensor<?xi64>
  %out_flat = flow.dispatch @{name}_executable::@paged_decode_attention[%workgroups](%q_flat, %cache, %table,
      %visible, %rows, %heads, %kv_heads, %head_dim, %stride, %blocks{extra_args}, %cache_size)
      : (tensor<{q_elems}xf32>, tensor<?x{element}>{{%cache_size}}, tensor<?xi64>{{%table_size}}, tensor<{rows}xi64>,
         index, index, index, index, index, index{extra_types}, index) -> tensor<{q_elems}xf32>
  %out = tensor.expand_shape %out_flat [[0, 1, 2]] output_shape [{rows}, {heads}, {head_dim}]
      : tensor<{q_elems}xf32> into {q_type}
  util.return %out : {q_type}
}}
}}"""


@CustomOp.register(library=KILN_LIBRARY)
class paged_decode_attention(CustomOp):
    """One query token a row (q [N, H, D] float32, scaled by 1/sqrt(D)) attending to its cached
    keys in place: key_pages [X, D, stride] (the cache viewed as K pages), pages [N, Hkv, B] int64
    (each block's K page), visible [N] int64 (keys each row sees) -> float32 [N, H, D]."""

    signature = "paged_decode_attention(Tensor q, Tensor key_pages, Tensor pages, Tensor visible) -> Tensor"

    def select(self, ksel: KernelSelection):
        q, key_pages, pages, visible = (ksel.arg_tensor(i) for i in range(4))
        torch._check(q.t.dtype == key_pages.t.dtype == torch.float32 and q.t.dim() == 3 and key_pages.t.dim() == 3,
                     lambda: "paged_decode_attention: float32 q [N, H, D] and key pages [X, D, stride]")
        torch._check(pages.t.dtype == visible.t.dtype == torch.int64 and pages.t.dim() == 3 and visible.t.dim() == 1,
                     lambda: "paged_decode_attention: int64 pages [N, Hkv, B] and visible [N]")
        q.specialize_dims(0, 1, 2)
        key_pages.specialize_dims(1, 2)
        pages.specialize_dims(0, 1)
        visible.specialize_dims(0)
        ksel.return_new_tensor(list(q.t.shape), torch.float32).specialize_dims(0, 1, 2)

    def eager_execute(self, q, key_pages, pages, visible):
        return eager_decode_attention(q, key_pages, pages, visible)

    def generate(self, ksel: KernelSelection, kb: KernelBuilder):
        rows, heads, head_dim = ir.RankedTensorType(kb.arg_bindings[0].type).shape
        stride = ir.RankedTensorType(kb.arg_bindings[1].type).shape[2]
        kv_heads = ir.RankedTensorType(kb.arg_bindings[2].type).shape[1]
        name = f"kiln_paged_decode_attention_{rows}x{heads}x{kv_heads}x{head_dim}x{stride}"
        emit_function(kb, name, _decode_attention_text(name, rows, heads, kv_heads, head_dim, stride))


class _ByteCacheAttention(CustomOp):
    """paged_decode_attention over a byte cache of FORMAT (models/kv_quant.py): key_pages [X, D,
    stride] int8 bytes, its pages of `page_blocks` blocks each keeping their first `value_blocks`'
    scales in the rest (models/llama.py's CachePages)."""

    FORMAT = ""

    def select(self, ksel: KernelSelection):
        q, key_pages, pages, visible = (ksel.arg_tensor(i) for i in range(4))
        ksel.attr_int(4)
        ksel.attr_int(5)
        name = self.name
        torch._check(q.t.dtype == torch.float32 and key_pages.t.dtype == torch.int8 and q.t.dim() == 3
                     and key_pages.t.dim() == 3,
                     lambda: f"{name}: float32 q [N, H, D] and int8 key pages [X, D, stride]")
        torch._check(pages.t.dtype == visible.t.dtype == torch.int64 and pages.t.dim() == 3 and visible.t.dim() == 1,
                     lambda: f"{name}: int64 pages [N, Hkv, B] and visible [N]")
        q.specialize_dims(0, 1, 2)
        key_pages.specialize_dims(1, 2)
        pages.specialize_dims(0, 1)
        visible.specialize_dims(0)
        ksel.return_new_tensor(list(q.t.shape), torch.float32).specialize_dims(0, 1, 2)

    def eager_execute(self, q, key_pages, pages, visible, page_blocks, value_blocks):
        keys, values = dequantized_pages(key_pages, page_blocks, value_blocks, self.FORMAT)
        return eager_decode_attention(q, keys, pages, visible, values)

    def generate(self, ksel: KernelSelection, kb: KernelBuilder):
        rows, heads, head_dim = ir.RankedTensorType(kb.arg_bindings[0].type).shape
        stride = ir.RankedTensorType(kb.arg_bindings[1].type).shape[2]
        kv_heads = ir.RankedTensorType(kb.arg_bindings[2].type).shape[1]
        page = (ksel.arg_descs[4].v, ksel.arg_descs[5].v)
        kernel = BYTE_KERNEL_SYMBOLS[self.FORMAT]
        name = f"{kernel}_{rows}x{heads}x{kv_heads}x{head_dim}x{stride}_{page[0]}x{page[1]}"
        emit_function(kb, name, _decode_attention_text(name, rows, heads, kv_heads, head_dim, stride, page, kernel))


@CustomOp.register(library=KILN_LIBRARY)
class paged_decode_attention_int8(_ByteCacheAttention):
    FORMAT = "int8"
    signature = ("paged_decode_attention_int8(Tensor q, Tensor key_pages, Tensor pages, Tensor visible, "
                 "int page_blocks, int value_blocks) -> Tensor")


@CustomOp.register(library=KILN_LIBRARY)
class paged_decode_attention_fp8_e4m3(_ByteCacheAttention):
    FORMAT = "fp8_e4m3"
    signature = ("paged_decode_attention_fp8_e4m3(Tensor q, Tensor key_pages, Tensor pages, Tensor visible, "
                 "int page_blocks, int value_blocks) -> Tensor")


# The kernel op for each cache element type it reads.
KERNELS = {"float32": paged_decode_attention, "int8": paged_decode_attention_int8,
           "fp8_e4m3": paged_decode_attention_fp8_e4m3}
