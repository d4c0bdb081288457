"""Weights stored narrower than the activations: bfloat16; int8 with a scale per output row; or
int8 values in llama.cpp's blocks of input channels of a row (32; Q6_K's 16), a scale per
block (Q8_0, Q4_0, Q5_0, Q6_K) and an offset too (Q4_1, Q5_1, Q4_K, Q5_K).

Only the weight matmuls and the token embedding change; activations, norms, attention and the
KV cache stay float32. How a matmul uses the narrow weight depends on the call:

- One token per row (decode, and the output head of prefill_last): the step streams every
  weight once, so its bytes are its time. The matmul takes the weight as stored, in a
  narrow-input kernel (`matmul`): bf16 rounds its input to bf16 and sums the products in
  float32 (AVX512-BF16, GPUs' bf16 tensor cores); int8 quantizes its input too, per token and
  per group of ACTIVATION_GROUP input channels (as llama.cpp's Q8_0 dot products quantize
  theirs per 32), one int8 x int8 -> int32 matmul per group, summed with the groups' scales.
  The block types group their input by the weight's own blocks, so each group's sum takes both
  scales; a block's offset adds its input sum times the offset (llama.cpp's Q4_1 dot product
  adds the same term).
- Many tokens per row (prefill, denoising): compute-bound, so the weight is widened to float32
  and the matmul runs as a float32 one (on this CPU a bf16 or grouped-int8 matmul of 512 rows
  was slower than the float32 one; benchmarks/NOTES.md). The weight's bytes stay narrow. 4-bit
  values held two a byte are the exception: the kernel that holds them so tiles many rows (four
  input rows by four weight rows of int8 dot products), and widening them cost a fifth of a
  prefill, so every row of theirs goes there, each row's arithmetic a decode step's.

int8 weights are scaled symmetrically per output row (scale = max|w| / 127). Quantizing the
activations per token alone, with no groups, moved SmolLM2's mean log-probability 2.9%; per
group of 64, 0.6%.

Q8_0 quantizes by ggml's rule (d = max|block| / 127 rounded to float16, q = x / d rounded half
away from zero). Re-quantizing what a Q8_0 GGUF dequantizes to gives back the file's blocks bit
for bit (its largest |q| in a block is 127, so d comes back exactly): a Q8_0 file is served from
its own values although the GGUF loader hands over float32 tensors. The other types cannot be
recovered that way, so the loader reads a GGUF's blocks of every type it serves as they are
stored (models/gguf_blocks.py) and `quantize_model` takes them; weights from anywhere else are
quantized by gguf-py's reference quantizer for the mode's type. The scales are held as float32 (each
float16 scale exactly): IREE 3.13 widened a float16 table on every call rather than once, 1.9
ms of a decode step for the tied embedding's.

The narrow kernel is a function the model is given (`matmul`): eager torch runs
`eager_weight_matmul`; the export passes an IREE custom op with the same arithmetic. A kernel
may also offer `matmul.rows_blocks(q [M, K], xs [M, G], w [N, K], ws [G, N], xsum [M, G], wo [G, N])`,
a block weight times M quantized rows of input whole (both scales, the offset term and the sum
over the blocks in one call), each row's result the same whatever rows share the call: a
one-token product in blocks of 32 (a decode step at any batch size) then goes there instead, and
so do Q6_K's blocks of 16 (ws [2 G, N], a scale per half block; its input quantized per 32 rather
than per 16) and an int8 one with row scales (ws [N], its input quantized per 32 rather than per
group). And
`matmul.rows_nibbles(q [M, K], xs [M, G], w [N, K / 2], ws, xsum [M, G], wo)`, the same for M
rows of input and 4-bit values stored two a byte (`pack_nibbles`): where the kernel offers it,
the 4-bit types (NIBBLE_TYPES) keep their values that way and every product goes there (a decode
step at any batch size, streaming half the bytes of int8 values, and a prefill's rows, M dynamic).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from kiln.runtime.config import QUANTIZATIONS

from .gguf_blocks import BLOCK, BlockWeight, quantize_blocks
from .lazy_arrays import LazyArrays

_INT8_MAX = 127.0
_TINY = 1e-30  # the scale of an all-zero row: any positive value quantizes it to zeros
ACTIVATION_GROUP = 64  # input channels that share an int8 activation scale
Q8_0_BLOCK = BLOCK  # input channels per Q8_0 block (ggml's QK8_0)
# Block modes -> the GGUF type a weight not read from a file's blocks is quantized to. "gguf"
# serves every block type the file holds as it is (a k-quant file's mix of Q4_K and Q6_K).
BLOCK_MODES = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1", "gguf": "Q8_0"}
# The block types whose values fit in 4 bits, kept two a byte where the matmul takes them so. Q4_0's
# values q - 8 are held as q with an offset of -8 d, so every packed value is unsigned.
NIBBLE_TYPES = ("Q4_0", "Q4_1", "Q4_K")
# Float32 weights kept as they are, held here only so that their one-token matmuls go through
# the model's `matmul` too (an export's hand-written CPU kernel); not a storage choice of its own.
FLOAT32 = "f32"


def eager_weight_matmul(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None = None,
                        x_sum: torch.Tensor | None = None, w_offset: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., M, K] @ w [..., N, K]^T (batched alike) for bf16 inputs (float32 result) or int8
    ones (int32, exact). With w_scale (int8 only; [..., 1, N]), the sums come back as float32
    times their column's scale, and with x_sum [..., M, 1] and w_offset [..., 1, N] plus their
    product."""
    if x.dtype == torch.int8:
        # float64 sums of int8 products are exact far past any model's K (|sum| < 2^53), and
        # unlike an int32 matmul they run as BLAS.
        sums = (x.double() @ w.double().transpose(-1, -2)).to(torch.int32)
        if w_scale is None:
            return sums
        scaled = sums.float() * w_scale
        return scaled if w_offset is None else scaled + x_sum * w_offset
    return x.float() @ w.float().transpose(-1, -2)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values and float32 scales [..., 1] of x's rows, symmetric: x ≈ q * scale."""
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=_TINY) / _INT8_MAX
    return torch.round(x / scale).clamp(-_INT8_MAX, _INT8_MAX).to(torch.int8), scale


def round_half_away(x: torch.Tensor) -> torch.Tensor:
    """C's roundf, which ggml quantizes with (torch.round rounds halves to even)."""
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def quantize_q8_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values [N, K] and scales [K / 32, N] (float16 values, held as float32; block-major:
    each group's scales are one row of N, as the decode matmul reads them) of `weight` in Q8_0
    blocks, by ggml's rule."""
    n, k = weight.shape
    blocks = weight.float().reshape(n, k // Q8_0_BLOCK, Q8_0_BLOCK)
    d = blocks.abs().amax(dim=-1, keepdim=True) / _INT8_MAX
    inverse = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    q = round_half_away(blocks * inverse).clamp(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    return q.reshape(n, k), d.squeeze(-1).to(torch.float16).float().T.contiguous()


def pack_nibbles(values: torch.Tensor) -> torch.Tensor:
    """Values 0-15 [N, K] (K a multiple of BLOCK) two a byte, int8 [N, K / 2], as ggml lays out a
    4-bit block: byte j of a block's 16 holds value j in its low nibble and value j + 16 in its
    high one."""
    n, k = values.shape
    halves = values.to(torch.int16).view(n, k // BLOCK, 2, BLOCK // 2)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).to(torch.uint8).view(torch.int8).reshape(n, k // 2)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """`pack_nibbles` undone on the last dim: int8 [..., K / 2] -> values 0-15, int8 [..., K]. The
    shift is masked after, so it is right whether the compiler shifts the sign in or not."""
    *lead, half = packed.shape
    blocks = packed.reshape(*lead, half // (BLOCK // 2), 1, BLOCK // 2)
    values = torch.cat([blocks & 0x0F, (blocks >> 4) & 0x0F], dim=-2)
    return values.reshape(*lead, half * 2)


def activation_group(k: int) -> int:
    """Input channels per activation scale: ACTIVATION_GROUP where it divides K, else all K."""
    return ACTIVATION_GROUP if k % ACTIVATION_GROUP == 0 else k


def widened(weight: torch.Tensor, scale: torch.Tensor | None, offset: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 weight that stored bytes stand for: bf16 (no scale), int8 with row scales [N],
    or int8 blocks with block scales [K / block, N] (and offsets of that shape, for the types
    with a block minimum). Weights stacked on leading axes ([..., N, K]) take their scales stacked alike."""
    w = weight.float()
    if scale is None:
        return w
    if scale.dim() < w.dim():  # row scales
        return w * scale.unsqueeze(-1)
    *lead, n, k = w.shape
    blocks = w.view(*lead, n, scale.shape[-2], -1) * scale.transpose(-1, -2).unsqueeze(-1)
    if offset is not None:
        blocks = blocks + offset.transpose(-1, -2).unsqueeze(-1)
    return blocks.view(*lead, n, k)


def blocks_of_input(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """rows [M, K] quantized to int8 per block of 32 as the block kernels take them: values
    [M, K], block scales [M, G] and the blocks' sums of quantized values [M, G] (float32)."""
    m, k = rows.shape
    q, scale = quantize_rows(rows.float().view(m, k // BLOCK, BLOCK))  # [M, G, 32], [M, G, 1]
    return q.view(m, k), scale.view(m, -1), q.float().sum(dim=-1)


def weight_product(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, matmul,
                   offset: torch.Tensor | None = None, packed: bool = False) -> torch.Tensor:
    """x [..., T, K] times a stored weight [N, K]^T (see `widened`; [N, K / 2] when `packed`, two
    4-bit values a byte): float32 [..., T, N]. T is 1 in a decode step (static); a dynamic or
    larger T is a prefill."""
    one_token = isinstance(x.shape[-2], int) and x.shape[-2] == 1
    n, k = weight.shape[0], x.shape[-1]
    if packed:
        # Values two a byte are held so only where the matmul has the 4-bit kernel, which takes
        # any number of rows: a prefill's too, each row's arithmetic a decode step's.
        q, row_scale, x_sum = blocks_of_input(x.reshape(-1, k))
        out = matmul.rows_nibbles(q, row_scale, weight, scale, x_sum, offset)
        return out.view(*x.shape[:-1], n)
    if not one_token:
        # The rows flattened: a [1, T, K] input kept its batch of one and IREE took it for a
        # batched matmul over a transposed copy, summing otherwise than the [B * T, K] matmul
        # of a wider batch: a prompt's logits then changed with the batch it was prefilled in.
        out = F.linear(x.reshape(-1, k).float(), widened(weight, scale, offset))
        return out.view(*x.shape[:-1], n)
    rows = x.reshape(-1, k)
    if weight.dtype in (torch.bfloat16, torch.float32):
        return matmul(rows.to(weight.dtype), weight).view(*x.shape[:-1], n)
    blocks = scale.dim() == 2
    group = k // scale.shape[0] if blocks else activation_group(k)
    whole = getattr(matmul, "rows_blocks", None)
    # The rows whole through the block kernel: blocks of 32; half blocks of 16 without offsets
    # (Q6_K's, each half its own scale, the input quantized per 32); or int8 with row scales (every
    # block of a row takes the row's scale; its input quantized per 32 rather than per group).
    fits = group == BLOCK or (group == BLOCK // 2 and offset is None and k % BLOCK == 0) if blocks else (
        k % BLOCK == 0)
    if whole is not None and fits:
        q, row_scale, x_sum = blocks_of_input(rows)
        out = whole(q, row_scale, weight, scale, None if offset is None else x_sum, offset)
        return out.view(*x.shape[:-1], n)
    q, row_scale = quantize_rows(rows.float().view(-1, k // group, group))  # [M, G, g], [M, G, 1]
    q, w = q.transpose(0, 1), weight.view(n, k // group, group).transpose(0, 1)  # [G, M, g], [G, N, g]
    if blocks and offset is not None:
        # Each block's input sum times its offset, from the quantized input as llama.cpp's
        # Q4_1 dot product takes it: the product is then the dequantized weight's with the
        # dequantized input. The float input's sum would leave the quantization error of
        # the d * q part uncancelled by the offset's, and Q4_1's values are all >= 0: that
        # moved a tiny model's logits 2.7% where this moves them 1.3%. Added in the matmul's
        # own call, as the scale is, rather than as a separate [M, G] x [G, N] product (the
        # two measured within noise of each other; benchmarks/NOTES.md).
        x_sum = q.float().sum(dim=-1, keepdim=True)  # [G, M, 1]
        sums = matmul(q, w, scale.unsqueeze(1), x_sum, offset.unsqueeze(1))
    elif blocks:
        # Each block's sum takes its weight scale in the matmul's own call, so what is
        # left is the int8 form's sum over blocks: with both scales in one expression
        # over the block axis, IREE 3.13's CPU code for it took 95-125 us per weight
        # matmul, about 20x the int8 form's sum (benchmarks/NOTES.md).
        sums = matmul(q, w, scale.unsqueeze(1))  # [G, M, N], block scales [G, 1, N] applied
    else:
        sums = matmul(q, w).float()  # [G, M, N]
    out = (sums * row_scale.permute(1, 0, 2)).sum(dim=0)
    if not blocks:
        out = out * scale
    return out.view(*x.shape[:-1], n)


def _parameter(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def stored_form(weight: torch.Tensor, mode: str, stored: BlockWeight | None = None, pack: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, bool]:
    """(values, scale, offset, packed) of a float [N, K] weight stored as `mode` says (see
    QuantizedWeight), or of `stored`, a block mode's weight as a GGUF holds it; 4-bit values are
    packed two a byte where `pack` says the consumer takes them so."""
    if mode not in (*QUANTIZATIONS[1:], FLOAT32):
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS[1:])}, got {mode!r}")
    weight = weight.detach().float()
    blocks = mode in BLOCK_MODES and weight.shape[-1] % BLOCK == 0
    if mode == FLOAT32:
        return weight, None, None, False
    if mode == "bf16":
        return weight.to(torch.bfloat16), None, None, False
    if blocks and stored is None and BLOCK_MODES[mode] == "Q8_0":
        return (*quantize_q8_0(weight), None, False)
    if blocks:
        if stored is None:
            stored = quantize_blocks(weight.numpy(), BLOCK_MODES[mode])
        values, scale = torch.from_numpy(stored.values), torch.from_numpy(stored.scales)
        offset = None if stored.offsets is None else torch.from_numpy(stored.offsets)
        if pack and stored.type_name in NIBBLE_TYPES and stored.block == BLOCK:
            if offset is None:  # Q4_0: d * (q - 8) = d * q - 8 d, exact in float32
                values, offset = values + 8, scale * -8.0
            return pack_nibbles(values), scale, offset, True
        return values, scale, offset, False
    values, row_scale = quantize_rows(weight)
    return values, row_scale.view(-1), None, False


class QuantizedWeight(nn.Module):
    """A [N, K] float weight stored as `mode` says; `scale` [N] for int8, [K / block, N] for the
    block modes, None for bf16 and FLOAT32; `offset` [K / block, N] for the types with a block minimum, else
    None. `stored`, a block mode's weight as a GGUF holds it (any block type), is taken as it
    is. A weight whose K is no multiple of 32 is stored as int8 in a block mode (llama.cpp falls
    back to a wider type for such tensors too). `packed`: 4-bit values held two a byte
    ([N, K / 2], always with an offset), where `matmul` has a one-token kernel for them."""

    def __init__(self, weight: torch.Tensor, mode: str, matmul=eager_weight_matmul,
                 stored: BlockWeight | None = None):
        super().__init__()
        values, scale, offset, self.packed = stored_form(weight, mode, stored, hasattr(matmul, "rows_nibbles"))
        self.scale = None if scale is None else _parameter(scale)
        self.offset = None if offset is None else _parameter(offset)
        self.weight = _parameter(values)
        self.matmul = matmul

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def values(self) -> torch.Tensor:
        """The stored values one an element ([N, K]), unpacked where they are held two a byte."""
        return unpack_nibbles(self.weight) if self.packed else self.weight

    def dequantized(self) -> torch.Tensor:
        """The float32 weight these bytes stand for."""
        return widened(self.values(), self.scale, self.offset)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        return weight_product(x, self.weight, self.scale, self.matmul, self.offset, self.packed)


class QuantizedLinear(QuantizedWeight):
    """nn.Linear with a quantized weight (the bias, if any, stays float32)."""

    def __init__(self, linear: nn.Linear, mode: str, matmul=eager_weight_matmul, stored: BlockWeight | None = None):
        super().__init__(linear.weight, mode, matmul, stored)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.project(x)
        return out if self.bias is None else out + self.bias


class QuantizedEmbedding(QuantizedWeight):
    """nn.Embedding with quantized rows; `project` is the tied output head over the same bytes."""

    def __init__(self, embedding: nn.Embedding, mode: str, matmul=eager_weight_matmul,
                 stored: BlockWeight | None = None):
        super().__init__(embedding.weight, mode, matmul, stored)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.scale is not None and self.scale.dim() == 2:  # blocks: a scale per block of the row
            rows = self.weight[tokens]
            rows = (unpack_nibbles(rows) if self.packed else rows).float()
            k = rows.shape[-1]
            rows = rows.view(*tokens.shape, self.scale.shape[0], -1)
            # Each token's column of the tables, gathered where it lies: `scale.T[tokens]` would
            # leave the compiler a transposed copy of the whole table to hoist, one per function.
            rows = rows * self.scale[:, tokens].movedim(0, -1).unsqueeze(-1)
            if self.offset is not None:
                rows = rows + self.offset[:, tokens].movedim(0, -1).unsqueeze(-1)
            return rows.view(*tokens.shape, k)
        rows = self.weight[tokens].float()
        return rows if self.scale is None else rows * self.scale[tokens].unsqueeze(-1)


def stacked_linear(layers, x: torch.Tensor) -> torch.Tensor:
    """x through linear layers that share it, as one matmul over their weights concatenated: the
    stored stack where they are its rows (an export's, models/stacked_projections.py), else
    concatenated here. LoRA-wrapped layers (models/lora.py) stack their bases and add their deltas."""
    if any(hasattr(layer, "delta") for layer in layers):
        adapted = [hasattr(layer, "delta") for layer in layers]
        out = stacked_linear([layer.base if wrapped else layer for layer, wrapped in zip(layers, adapted)], x)
        return out + torch.cat([layer.delta(x) if wrapped else x.new_zeros(*x.shape[:-1], layer.out_features)
                                for layer, wrapped in zip(layers, adapted)], dim=-1)
    stack = getattr(layers[0], "stack", None)  # the export's stored stack (models/stacked_projections.py)
    if (stack is not None and [getattr(layer, "stack", None) for layer in layers] == [stack] * len(stack.sizes)
            and [layer.index for layer in layers] == list(range(len(layers)))):
        return stack(x)
    bias = torch.cat([layer.bias for layer in layers]) if layers[0].bias is not None else None
    if not isinstance(layers[0], QuantizedLinear):
        return F.linear(x, torch.cat([layer.weight for layer in layers]), bias)
    packed = [layer.packed for layer in layers]
    if any(packed) and not all(packed):
        # 4-bit values two a byte beside other blocks (a Q4_K q/k beside a Q6_K v): a product
        # each, so that no values are unpacked to be stacked.
        return torch.cat([layer(x) for layer in layers], dim=-1)
    weight = torch.cat([layer.weight for layer in layers])
    # Row scales [N] and the block scales and offsets [K / block, N] all run along N.
    scale = None if layers[0].scale is None else torch.cat(same_blocks([layer.scale for layer in layers]), dim=-1)
    offset = None
    if any(layer.offset is not None for layer in layers):  # a block type without offsets has zeros
        offset = torch.cat(same_blocks([torch.zeros_like(layer.scale) if layer.offset is None else layer.offset
                                         for layer in layers]), dim=-1)
    out = weight_product(x, weight, scale, layers[0].matmul, offset, all(packed))
    return out if bias is None else out + bias


def same_blocks(tables: list[torch.Tensor]) -> list[torch.Tensor]:
    """Block scale (or offset) tables [K / block, N] of one K brought to the smallest block among
    them by repeating each row: a Q4_K q/k beside a Q6_K v (blocks of 32 and 16). Exact."""
    if tables[0].dim() == 1:
        return tables
    most = max(t.shape[0] for t in tables)
    return [t if t.shape[0] == most else t.repeat_interleave(most // t.shape[0], dim=0) for t in tables]


def block_type(stored: Mapping[str, BlockWeight], name: str) -> str:
    """The block type of stored[name], without making it where the blocks are lazy."""
    return stored.kind(name) if isinstance(stored, LazyArrays) else stored[name].type_name


def quantize_model(model: nn.Module, mode: str, matmul=eager_weight_matmul,
                   stored: Mapping[str, BlockWeight] | None = None, load=None) -> nn.Module:
    """Replace every nn.Linear and nn.Embedding under `model` by its quantized form, in place.
    In a block mode, a weight found in `stored` (by parameter name, "model.layers.0.mlp.up_proj.weight")
    keeps those blocks, a GGUF's own, where they are of the mode's type or Q8_0 (any type, for
    "gguf"); the others are quantized to the mode's type.

    A mixture's stacked experts are stored the same way (models/quantized_experts.py); its router stays
    float32. A replaced weight keeps the device it was placed on (a tensor/pipeline-parallel model's
    placement is a trait of each parameter). `load(child, prefix, skip=names)`, for a model built on
    the meta device (models/meta_load.py), makes a module's parameters but those in `skip` (a weight
    whose stored blocks are taken instead) before it is replaced."""
    if mode == "none":
        return model
    from iree.turbine.aot import DeviceTensorTrait

    from .llama import Experts
    from .quantized_experts import quantize_experts

    # A weight stored as the mode's type keeps its blocks, and so does a Q8_0 one (a Q4 file's
    # embedding): exact either way, where re-quantizing would round the file's values again.
    stored = stored or {}
    kept = {name for name in stored
            if mode == "gguf" or (mode in BLOCK_MODES and block_type(stored, name) in (BLOCK_MODES[mode], "Q8_0"))}
    # By path and name, not by module: a list of the modules would hold each replaced nn.Linear,
    # and the float32 weight `load` made for it, to the end (32 GB at 8B from a bf16 checkpoint).
    for path in [path for path, _ in model.named_modules()]:
        module = model.get_submodule(path)
        for name in [name for name, _ in module.named_children()]:
            child = getattr(module, name)
            prefix = f"{path}.{name}." if path else f"{name}."
            if type(child) is Experts and mode != FLOAT32:  # float32 experts are already as they would be
                device = DeviceTensorTrait.get(child.gate_proj)
                replacement = quantize_experts(child, mode, lambda p: stored[prefix + p] if prefix + p in kept else None,
                                               load, prefix, matmul)
            elif type(child) in (nn.Linear, nn.Embedding):
                weight = prefix + "weight"
                blocks = stored[weight] if weight in kept else None
                if load is not None:
                    load(child, prefix, skip=("weight",) if blocks is not None else ())
                device = DeviceTensorTrait.get(child.weight)
                kind = QuantizedLinear if type(child) is nn.Linear else QuantizedEmbedding
                replacement = kind(child, mode, matmul, blocks)
            else:
                continue
            if device is not None:
                for parameter in replacement.parameters():
                    device.set(parameter)
            setattr(module, name, replacement)
    return model
