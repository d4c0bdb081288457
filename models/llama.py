"""A Llama-family decoder in plain torch, over a paged KV cache.

Read it top to bottom: RMSNorm, rotary embeddings, grouped-query attention,
SwiGLU. `forward_paged` is what the export traces (prefill and decode are the
same function with T new tokens at `start_pos`); `forward_reference` is a plain
pass with no cache, the yardstick for the tests. A diffusion LM (LLaDA, Dream) is the
same math without the causal mask: every position sees every other one. The other
families are this layer with the departures LlamaConfig names: QK-norm (Qwen3, Gemma 3),
GeGLU, scaled embeddings, norms after attention and the MLP, soft-capped scores and
sliding-window layers with their own rotary base (Gemma 2, 3).

Cache layout (the export/runtime contract, docs/abi.md): `cache[pages, page_elems]`,
each page `[layers, 2 (k, v), kv_heads, block_seq_stride * head_dim]` (with `page_groups`, a
model with sliding layers: the layers of one group, runtime/config.py's PageGroups): a K block is stored
transposed, `[head_dim, block_seq_stride]`, a V block as `[block_seq_stride, head_dim]` (see
CachePages for why). A byte cache's page (int8, fp8) then holds each block's scales, a token's in
two bytes (models/kv_quant.py), in whole blocks. Only the model reads inside a page; the runtime
counts pages.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math

import torch
import torch.nn.functional as F
from torch import nn

from kiln.runtime.config import KV_SCALE_BYTES, PageGroups, kv_page_elems, kv_scale_blocks

from . import kv_quant
from .config import SLIDING, LlamaConfig
from .quantize import QuantizedEmbedding, stacked_linear
from .rope import llama3_divisors, yarn_frequencies

# Added to the attention score of a key a query may not see: exp() of it is 0 in
# float32, and unlike -inf it keeps a fully masked (padding) row finite.
MASKED_SCORE = -1e30


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)


ROTARY_BUFFERS = ("inv_freq", "local_inv_freq", "long_inv_freq")


def rope_type(config: LlamaConfig) -> str | None:
    scaling = config.rope_scaling or {}
    return scaling.get("rope_type", scaling.get("type"))


def rope_inverse_frequencies(config: LlamaConfig, local: bool = False, long: bool = False) -> torch.Tensor:
    """Per-pair rotation speeds of the rotated dimensions (`rotary_dim`), scaled as configured;
    `local`: the sliding layers' own unscaled base (Gemma 3's rope_local_base_freq); `long`:
    LongRoPE's factors for sequences past the original context, else its short ones (Phi-3)."""
    dim = config.rotary_dim
    theta = config.rope_local_theta if local else config.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = {} if local else config.rope_scaling or {}
    kind = None if local else rope_type(config)
    if kind == "llama3":
        inv_freq = inv_freq / torch.from_numpy(llama3_divisors(inv_freq.numpy(), scaling))
    elif kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "yarn":
        inv_freq = torch.from_numpy(yarn_frequencies(theta, dim, scaling, config.max_position_embeddings)[0])
    elif kind in ("longrope", "su"):
        factors = scaling["long_factor" if long else "short_factor"]
        if len(factors) != dim // 2:
            raise ValueError(f"LongRoPE has {len(factors)} factors for {dim // 2} rotary pairs")
        inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float64)
    elif kind not in (None, "default"):
        raise ValueError(f"unsupported rope scaling type {kind!r}")
    return inv_freq.float()


def rope_attention_factor(config: LlamaConfig) -> float:
    """What LongRoPE and YaRN multiply cos and sin by (1 for every other rotary), as transformers computes it."""
    kind = rope_type(config)
    if kind == "yarn":
        return yarn_frequencies(config.rope_theta, config.rotary_dim, config.rope_scaling,
                                config.max_position_embeddings)[1]
    if kind not in ("longrope", "su"):
        return 1.0
    scaling = config.rope_scaling
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or config.max_position_embeddings / original
    return math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1.0 else 1.0


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x rotated by (cos, sin); where those cover fewer dimensions than x's heads (partial rotary,
    Phi-4-mini), only that leading part of each head rotates, the rest passes as it is."""
    rotated = cos.shape[-1]
    if rotated == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    head, rest = x[..., :rotated], x[..., rotated:]
    return torch.cat((head * cos + rotate_half(head) * sin, rest), dim=-1)


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap·tanh(x / cap): Gemma 2's bound on scores and logits (x itself when cap is None)."""
    return x if cap is None else torch.tanh(x / cap) * cap


class Attention(nn.Module):
    """`sliding`: a local layer's, whose queries see only the last `sliding_window` keys;
    `rotates`: whether its q and k take the rotary (not in SmolLM3's NoPE layers)."""

    def __init__(self, config: LlamaConfig, sliding: bool = False, rotates: bool = True):
        super().__init__()
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.sliding = sliding
        self.rotates = rotates
        self.scale = (config.query_pre_attn_scalar or config.head_dim) ** -0.5
        self.softcap = config.attn_logit_softcapping
        # Over each head's q and k, or (OLMo 2) over all of them at once, before they part into heads.
        self.qk_norm_whole = config.qk_norm_whole
        q_width, k_width = (self.n_heads, self.n_kv_heads) if config.qk_norm_whole else (1, 1)
        self.q_norm = RMSNorm(q_width * self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(k_width * self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, config.hidden_size, bias=False)
        # Attention over the gathered pages as one fused op (SDPA) rather than matmuls and a
        # blocked softmax: IREE lowers it to its attention op, a flash-attention kernel on GPUs,
        # in fewer dispatches; an export for GPUs sets it (ExportOptions.attention).
        self.fused = False

    def project(self, x, cos, sin):
        """q [N,H,T,D] and k, v [N,Hkv,T,D] for x [N,T,hidden], rotary applied to q and k."""
        n, t, _ = x.shape
        projections = (self.q_proj, self.k_proj, self.v_proj)
        if t == 1:
            # Decode: one matmul over the three weights (an export stores them as one,
            # models/stacked_projections.py): two dispatches fewer per layer, ~1 ms of a
            # batch-1 step here.
            # Prefill keeps three: splitting the fused result made its rotary pass slower
            # than the merge saved (benchmarks/NOTES.md).
            sizes = [p.out_features for p in projections]
            q, k, v = stacked_linear(projections, x).split(sizes, dim=-1)
        else:
            q, k, v = (p(x) for p in projections)
        if self.qk_norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(n, t, self.n_heads, self.head_dim)
        k = k.reshape(n, t, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None and not self.qk_norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.reshape(n, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if not self.rotates:
            return q, k, v
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def attend(self, q, k, v, mask):
        """SDPA with grouped-query heads; mask is boolean [N,1,T,S] (True = may attend)."""
        group = self.n_heads // self.n_kv_heads
        if group > 1:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        if self.softcap is None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        else:
            scores = soft_cap(torch.matmul(q, k.transpose(-1, -2)) * self.scale, self.softcap)
            out = torch.matmul(torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1), v)
        n, _, t, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(n, t, self.n_heads * self.head_dim))

    def attend_paged(self, q, keys_t, values, bias, block, scales=None):
        """Attention over cached pages, written as matmuls and a blocked softmax.

        q [N,H,T,D]; keys_t [N,Hkv,D,S] (transposed); values [N,Hkv,S,D]; bias
        [N,1,T,S] (0 where a query may look, a large negative number elsewhere);
        S is a multiple of `block`; `scales`, a byte cache's: each key's K and V scales
        ([N,Hkv,1,S] each), applied to the scores and to the weights. Why not SDPA: IREE lowers it to a fused attention
        op whose llvm-cpu code is ~10x slower than this at 512 tokens, and a softmax
        over one dynamic axis does not vectorize; viewed as [..., S/block, block], the
        static inner axis does. The query heads of a K/V group are stacked into one
        matmul, so K/V are read once per group and never copied. GPU builds (`fused`) take SDPA,
        which IREE's GPU code runs as one flash-attention kernel (attend_fused).
        """
        n, heads, t, d = q.shape
        kv_heads, s = keys_t.shape[1], keys_t.shape[3]
        group = heads // kv_heads
        dtype = q.dtype
        decode = t == 1
        if self.fused and scales is None and self.softcap is None:
            return self.attend_fused(q, keys_t.transpose(-1, -2), values, bias)
        if n == 1 and decode:
            # A lone decode row asks its query twice, as a two-token step would: IREE 3.13
            # miscompiles this form at N = 1, T = 1 on SmolLM2's shapes (three query heads
            # per K/V head; wrong logits), and compiles the two-query form right. The copy
            # costs one more row in two small matmuls; SDPA, the other correct form, made the
            # step twice as long here (22 against 11 ms: its fused attention op and a
            # transposing gather).
            q, bias = torch.cat((q, q), dim=2), torch.cat((bias, bias), dim=2)
        rows = q.shape[2]
        q = q.float().reshape(n, kv_heads, group * rows, d)
        scores = torch.matmul(q, keys_t.float())
        if scales is not None:
            scores = scores * scales[0]
        scores = soft_cap(scores * self.scale, self.softcap)
        scores = scores.view(n, kv_heads, group, rows, s) + bias.view(n, 1, 1, rows, s)
        blocks = scores.view(n, kv_heads, group, rows, s // block, block)
        weights = torch.exp(blocks - blocks.amax(dim=(-2, -1), keepdim=True))
        if decode:
            # Decode normalizes after the product: before it, IREE fuses the division into
            # the matmul and emits a zero-sized `affine.delinearize_index` at T = 1.
            total = weights.sum(dim=(-2, -1)).view(n, kv_heads, group * rows, 1)
            weights = weights.view(n, kv_heads, group * rows, s)
            if scales is not None:
                weights = weights * scales[1]
            out = torch.matmul(weights, values.float()) / total
        else:
            # Prefill normalizes first: after the product, IREE fuses the division into the
            # output projection's data-tiled packing and needs a dynamic stack allocation.
            weights = (weights / weights.sum(dim=(-2, -1), keepdim=True)).view(n, kv_heads, group * rows, s)
            if scales is not None:
                weights = weights * scales[1]
            out = torch.matmul(weights, values.float())
        out = out.view(n, kv_heads, group, rows, d)[:, :, :, :t]
        out = out.permute(0, 3, 1, 2, 4).reshape(n, t, heads * d)
        return self.o_proj(out.to(dtype))

    def attend_fused(self, q, keys, values, bias):
        """attend_paged as one SDPA: keys and values [N,Hkv,S,D], each K/V head repeated for its
        group of query heads (IREE's attention op takes equal head counts)."""
        n, heads, t, d = q.shape
        group = heads // keys.shape[1]
        if group > 1:
            keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), attn_mask=bias.to(q.dtype),
                                             scale=self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(n, t, heads * d))


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.gelu = config.hidden_act == "gelu_tanh"

    def forward(self, x):
        return self.down_proj(activate(self.gate_proj(x), self.gelu) * self.up_proj(x))


def activate(gate: torch.Tensor, gelu: bool) -> torch.Tensor:
    """A gated MLP's activation: GeGLU's tanh-approximate GELU, or SwiGLU's SiLU."""
    return F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)


class Experts(nn.Module):
    """Every expert's gated MLP, stacked: gate and up [E, I, H], down [E, H, I]. A quantized model
    holds them narrow instead (models/quantized_experts.py), behind the same two methods."""

    def __init__(self, experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.zeros(experts, intermediate, hidden))
        self.up_proj = nn.Parameter(torch.zeros(experts, intermediate, hidden))
        self.down_proj = nn.Parameter(torch.zeros(experts, hidden, intermediate))

    def chosen(self, name: str, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The experts `index` [M, k] picked of projection `name`: [M, k, N, K]."""
        return getattr(self, name)[index]

    def every(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """Every expert of projection `name`: [E, N, K]."""
        return getattr(self, name)

    # Float experts are gathered by `chosen`; a quantized stack may have a kernel that reads them
    # where they lie (models/quantized_experts.py's `chosen_product`).
    reads_in_place = False


class Router(nn.Linear):
    """A mixture's router: its own type so the quantizer leaves it in float (quantize_model replaces
    only nn.Linear itself). Rounded, it moves tokens to other experts, a jump rather than a small
    error; llama.cpp and vLLM keep routers unquantized too."""


def top_experts(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(probs, k) for routing probabilities [M, E] (non-negative), by k rounds of a max:
    IREE 3.13 compiles aten.topk wrongly inside a whole model's prefill here (wrong experts picked,
    though right in a module alone), and a max, a compare and a min compile right. A tie goes to
    the lower index."""
    index = torch.arange(probs.shape[-1])
    weights, chosen, remaining = [], [], probs
    for _ in range(k):
        top = remaining.amax(dim=-1, keepdim=True)
        first = torch.where(remaining == top, index, probs.shape[-1]).amin(dim=-1, keepdim=True)
        weights.append(top)
        chosen.append(first)
        remaining = torch.where(index == first, -1.0, remaining)
    return torch.cat(weights, dim=-1), torch.cat(chosen, dim=-1)


class SparseMoE(nn.Module):
    """A mixture of experts: a router (`gate`) scores the experts for each token, the top
    `num_experts_per_tok` by softmax run, and their outputs are summed by those weights
    (renormalized to 1 where the family does so), as Mixtral and Qwen3-MoE compute it.

    The experts run as a few batched matmuls, never one call per expert: a decode step gathers
    each token's chosen experts' weights and multiplies by them alone (it reads k experts per
    token, which is what bounds a step); a prefill multiplies every token by every expert and
    weighs each result by the routing, zero for an expert not chosen (more arithmetic, but
    static shapes and no per-expert dispatch). Experts a kernel reads where they lie
    (`reads_in_place`: a quantized stack's, with the CPU kernels) go there in decode and prefill
    alike: each token times its k chosen experts only."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate = Router(config.hidden_size, config.num_experts, bias=False)
        self.experts = Experts(config.num_experts, config.hidden_size, config.moe_intermediate_size)
        # Qwen2-MoE's shared expert: a dense MLP every token runs, scaled by a sigmoid of its own gate.
        shared = config.shared_expert_intermediate_size
        self.shared_expert = MLP(dataclasses.replace(config, intermediate_size=shared)) if shared else None
        self.shared_expert_gate = Router(config.hidden_size, 1, bias=False) if shared else None
        self.top_k, self.renormalize = config.num_experts_per_tok, config.norm_topk_prob
        self.gelu = config.hidden_act == "gelu_tanh"

    def routing(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [M,k] in x's dtype, experts [M,k]) for tokens x [M,H]."""
        weights, chosen = top_experts(torch.softmax(self.gate(x).float(), dim=-1), self.top_k)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), chosen

    def forward(self, x):
        n, t, hidden = x.shape
        tokens = x.reshape(n * t, hidden)
        weights, chosen = self.routing(tokens)
        e, dtype = self.experts, x.dtype
        if e.reads_in_place:
            out = (self.chosen_in_place(tokens, chosen) * weights.unsqueeze(-1)).sum(dim=1)
        elif t == 1:
            column = tokens.view(n, 1, hidden, 1)
            gate = torch.matmul(e.chosen("gate_proj", chosen, dtype), column)  # [M,k,I,1]
            up = torch.matmul(e.chosen("up_proj", chosen, dtype), column)
            out = torch.matmul(e.chosen("down_proj", chosen, dtype), activate(gate, self.gelu) * up).squeeze(-1)
            out = (out * weights.unsqueeze(-1)).sum(dim=1)  # [M,H]
        else:
            gate = torch.matmul(tokens, e.every("gate_proj", dtype).transpose(1, 2))  # [E,M,I]
            up = torch.matmul(tokens, e.every("up_proj", dtype).transpose(1, 2))
            out = torch.matmul(activate(gate, self.gelu) * up, e.every("down_proj", dtype).transpose(1, 2))  # [E,M,H]
            experts = torch.arange(self.gate.out_features).view(1, 1, -1)
            dense = ((chosen.unsqueeze(-1) == experts).to(x.dtype) * weights.unsqueeze(-1)).sum(dim=1)  # [M,E]
            out = (out * dense.t().unsqueeze(-1)).sum(dim=0)
        out = out.view(n, t, hidden)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_gate(x)) * self.shared_expert(x)
        return out

    def chosen_in_place(self, tokens: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """The chosen experts' outputs [M, k, H] for tokens [M, H] through the kernel that reads
        them where they lie."""
        e = self.experts
        hidden = activate(e.chosen_product("gate_proj", tokens, chosen), self.gelu) * \
            e.chosen_product("up_proj", tokens, chosen)  # [M, k, I]
        return e.chosen_product("down_proj", hidden, chosen).to(tokens.dtype)

    def shared_gate(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert's gate [N,T,1] before its sigmoid: a matmul over its one row padded with
        zero rows to eight. IREE 3.13's data tiling crashes on a contraction of one output column,
        whether a matmul or a product summed (iree-compile, CPU); eight columns compile."""
        weight = self.shared_expert_gate.weight
        padded = torch.cat((weight, torch.zeros(7, weight.shape[1], dtype=weight.dtype)))
        return F.linear(x, padded.to(x.dtype))[..., :1]


class Scaled(nn.Module):
    """x times a constant: what attention's and the MLP's outputs go through on their way into the
    residual where a family scales them (Granite's residual_multiplier) instead of norming them."""

    def __init__(self, factor: float):
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.tensor(self.factor, dtype=x.dtype)


class DecoderLayer(nn.Module):
    """Llama's names: `post_attention_layernorm` is the norm before the MLP. With sandwich norms
    (Gemma's), attention's and the MLP's outputs are normed before they join the residual too (and
    without pre_norms, OLMo 2's, only they are); with a residual multiplier (Granite's), scaled."""

    def __init__(self, config: LlamaConfig, index: int):
        super().__init__()
        pre_norm = (lambda: RMSNorm(config.hidden_size, config.rms_norm_eps)) if config.pre_norms else nn.Identity
        self.input_layernorm = pre_norm()
        self.self_attn = Attention(config, config.is_sliding(index), index not in config.unrotated_layers)
        self.post_attention_layernorm = pre_norm()
        self.mlp = SparseMoE(config) if config.is_moe(index) else MLP(config)
        self.attention_output_norm, self.mlp_output_norm = (self._output_path(config) for _ in range(2))

    @staticmethod
    def _output_path(config: LlamaConfig) -> nn.Module:
        if config.sandwich_norms:
            return RMSNorm(config.hidden_size, config.rms_norm_eps)
        return Scaled(config.residual_multiplier) if config.residual_multiplier != 1.0 else nn.Identity()


class Backbone(nn.Module):
    """Embeddings, layers and final norm, under HF's `model.` prefix."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


# Cache element types whose contract name is not torch's.
_CACHE_DTYPE_NAMES = {torch.float8_e4m3fn: "fp8_e4m3"}


def cache_dtype_name(dtype: torch.dtype) -> str:
    """The contract's name of a cache element type (runtime/config.py's KV_CACHE_DTYPES)."""
    return _CACHE_DTYPE_NAMES.get(dtype) or str(dtype).removeprefix("torch.")


def index_pages(pages: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`pages[index]`: whole pages by index. The export replaces it with IREE's own gather
    (export/page_gather.py), which compiles to a far faster page copy."""
    return pages[index]


class PagedLlama(nn.Module):
    """`gather_pages` copies whole pages by index (`index_pages`'s contract); `decode_attention`,
    when given, is a one-token step's attention reading the pages in place (the contract of
    export/cpu_attention.py's `paged_decode_attention`), used instead of gathering them.
    `page_groups`: each page holds one group's layers and the block table has a page per group
    ([N, groups, B]), so that a sliding group's pages can leave a sequence with its window."""

    def __init__(self, config: LlamaConfig, block_seq_stride: int = 16, gather_pages=index_pages,
                 decode_attention=None, page_groups: PageGroups | None = None):
        super().__init__()
        self.config = config
        self.page_groups = page_groups
        self.causal = not config.is_diffusion
        self.block_seq_stride = block_seq_stride
        self.gather_pages = gather_pages
        self.decode_attention = decode_attention
        self.model = Backbone(config)
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # Not parameters: small constants folded into the program, made on the CPU even where the
        # model is built on the meta device (models/meta_load.py).
        with torch.device("cpu"):
            self.register_buffer("inv_freq", rope_inverse_frequencies(config), persistent=False)
            local = rope_inverse_frequencies(config, local=True) if config.rope_local_theta is not None else None
            self.register_buffer("local_inv_freq", local, persistent=False)
            # LongRoPE: a sequence longer than the original context rotates by its long factors.
            longrope = rope_type(config) in ("longrope", "su")
            long = rope_inverse_frequencies(config, long=True) if longrope else None
            self.register_buffer("long_inv_freq", long, persistent=False)
        self.long_rope_from = config.rope_scaling["original_max_position_embeddings"] if longrope else None
        self.rotary_factor = rope_attention_factor(config)
        self.running_layers: int | None = None  # forward_paged runs this many layers (None: all)

    @contextlib.contextmanager
    def first_layer_only(self):
        """Within it, forward_paged runs the first layer alone: the same inputs written, the same
        outputs of the same shapes, for a fraction of the work (a trace's first pass, which learns
        only those, runs so: export/fast_trace.py)."""
        self.running_layers = 1
        try:
            yield
        finally:
            self.running_layers = None

    # -- sizes -------------------------------------------------------------------------
    @property
    def page_layers(self) -> int:
        """Layers whose blocks one page holds."""
        return self.page_groups.layers_per_page if self.page_groups else self.config.num_hidden_layers

    def page_elems(self, dtype=torch.float32) -> int:
        c = self.config
        return kv_page_elems(self.page_layers, c.num_key_value_heads, c.head_dim, self.block_seq_stride,
                             cache_dtype_name(dtype))

    def allocate_cache(self, pages: int, dtype=torch.float32) -> torch.Tensor:
        return torch.zeros(pages, self.page_elems(dtype), dtype=dtype)

    # -- weights -----------------------------------------------------------------------
    def load_tensors(self, tensors: dict, dtype=torch.float32):
        state = {name: torch.as_tensor(value).to(dtype) for name, value in tensors.items()}
        if self.lm_head is None:
            state.pop("lm_head.weight", None)
        missing, unexpected = self.load_state_dict(state, strict=False)
        missing = [m for m in missing if m not in ROTARY_BUFFERS]
        if missing or unexpected:
            raise ValueError(f"weights do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
        self.to(dtype)
        for name in ROTARY_BUFFERS:
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name).float())
        return self

    # -- shared pieces -----------------------------------------------------------------
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(tokens)
        multiplier = self.config.embedding_multiplier
        # In the embeddings' dtype, as Gemma scales them.
        return h if multiplier == 1.0 else h * torch.tensor(multiplier, dtype=h.dtype)

    def rotary(self, positions: torch.Tensor, dtype, seq_lens: torch.Tensor, local: bool = False):
        """cos, sin [N,1,T,R] (R: a head's rotated dimensions) for integer positions [N,T] of rows
        holding seq_lens [N] tokens; `local`: with the sliding layers' own base, unscaled."""
        inv_freq = self.local_inv_freq if local else self.inv_freq
        if self.long_inv_freq is not None and not local:
            # As transformers decides it: by the whole sequence's length, per row here.
            longer = (seq_lens > self.long_rope_from).view(-1, 1, 1)
            inv_freq = torch.where(longer, self.long_inv_freq, inv_freq)
        freqs = positions.unsqueeze(-1).float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
        cos, sin = emb.cos(), emb.sin()
        if self.rotary_factor != 1.0 and not local:  # LongRoPE's and YaRN's attention factor (scaled layers')
            cos, sin = cos * self.rotary_factor, sin * self.rotary_factor
        return cos.to(dtype), sin.to(dtype)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        h = self.model.norm(h)
        if self.lm_head is not None:
            logits = self.lm_head(h).float()
        elif isinstance(self.model.embed_tokens, QuantizedEmbedding):
            logits = self.model.embed_tokens.project(h)  # tied: the embedding's rows are the output head's
        else:
            logits = F.linear(h, self.model.embed_tokens.weight).float()
        if self.config.logits_scaling != 1.0:
            logits = logits / self.config.logits_scaling
        return soft_cap(logits, self.config.final_logit_softcapping)

    # -- reference: plain attention (causal unless a diffusion LM), no cache -----------
    def forward_reference(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [N,T,V] of a full pass (every row is a whole sequence)."""
        n, t = tokens.shape
        h = self.embed(tokens)
        positions = torch.arange(t).unsqueeze(0).expand(n, t)
        lengths = torch.full((n,), t)
        rotary = {False: self.rotary(positions, h.dtype, lengths)}
        rotary[True] = rotary[False] if self.local_inv_freq is None else self.rotary(positions, h.dtype, lengths, True)
        mask = torch.ones(t, t, dtype=torch.bool)
        mask = (mask.tril() if self.causal else mask).view(1, 1, t, t)
        window = self.config.sliding_window or t
        masks = {False: mask, True: mask & (torch.arange(t).view(1, t) > torch.arange(t).view(t, 1) - window)}
        for layer in self.model.layers:
            attn = layer.self_attn
            q, k, v = attn.project(layer.input_layernorm(h), *rotary[attn.sliding])
            h = h + layer.attention_output_norm(attn.attend(q, k, v, masks[attn.sliding]))
            h = h + layer.mlp_output_norm(layer.mlp(layer.post_attention_layernorm(h)))
        return self.logits(h)

    # -- paged: what prefill_bs<N> and decode_bs<N> run --------------------------------
    def forward_paged(
        self,
        tokens: torch.Tensor,  # [N, T] i64
        start_pos: torch.Tensor,  # [N] i64: position of tokens[:, 0]
        seq_lens: torch.Tensor,  # [N] i64: tokens in the sequence once these are written
        seq_block_ids: torch.Tensor,  # [N, B] i64: page of each block ([N, groups, B] with page_groups)
        cache: torch.Tensor,  # [pages, page_elems], updated in place
    ) -> torch.Tensor:
        """Hidden states [N,T,hidden] after writing the new K/V into the cache.

        Positions at or past seq_len are padding: their K/V go to page 0, which no
        request owns, so a padded row can never corrupt a live page. A causal model's
        query sees the keys up to its own position; a diffusion LM's sees every key below
        seq_len, the cached ones past the window included (Fast-dLLM's dual cache).
        """
        c = self.config
        h = self.embed(tokens)
        step = PagedStep.of(self, tokens, start_pos, seq_lens, seq_block_ids, h.dtype)
        pages = CachePages(cache, self.page_layers, c.num_key_value_heads, c.head_dim, self.block_seq_stride)
        for index, layer in enumerate(itertools.islice(self.model.layers, self.running_layers)):
            out = pages.attend(layer.self_attn, index, layer.input_layernorm(h), step, self.gather_pages,
                               self.decode_attention)
            h = h + layer.attention_output_norm(out)
            h = h + layer.mlp_output_norm(layer.mlp(layer.post_attention_layernorm(h)))
        return h


class PagedStep:
    """What every layer of one paged call shares: rotary tables, where each new token's K/V go,
    and which cached keys each query may see. Tensors, so a multi-device export can move them.
    A model with sliding-window layers has `local`: those layers' (cos, sin, bias); one with
    `groups` (PageGroups) a table and write pages per group ([N, groups, B], [N, groups, T])."""

    def __init__(self, cos, sin, write_page, write_slot, bias, visible, seq_block_ids, stride: int, local=None,
                 groups: PageGroups | None = None):
        self.cos, self.sin, self.write_page, self.write_slot = cos, sin, write_page, write_slot
        self.bias, self.visible, self.seq_block_ids, self.stride = bias, visible, seq_block_ids, stride
        self.local, self.groups = local, groups

    def pages_of(self, layer: int) -> tuple:
        """(table [N, B], write pages [N, T], the layer's place within a page) of layer `layer`."""
        if self.groups is None:
            return self.seq_block_ids, self.write_page, layer
        group, slot = self.groups.place(layer)
        return self.seq_block_ids[:, group], self.write_page[:, group], slot

    def view(self, sliding: bool) -> tuple:
        """(cos, sin, bias) of a layer, sliding or not."""
        return self.local if sliding else (self.cos, self.sin, self.bias)

    @classmethod
    def of(cls, model: "PagedLlama", tokens, start_pos, seq_lens, seq_block_ids, dtype) -> "PagedStep":
        stride = model.block_seq_stride
        n, t = tokens.shape
        blocks = seq_block_ids.shape[-1]
        positions = start_pos.unsqueeze(1) + torch.arange(t).unsqueeze(0)  # [N,T]
        cos, sin = model.rotary(positions, dtype, seq_lens)
        # Where each new token's K/V goes: page, slot within the page.
        live = positions < seq_lens.unsqueeze(1)
        block_index = torch.clamp(positions // stride, max=blocks - 1)
        if model.page_groups is None:
            write_page = torch.where(live, torch.gather(seq_block_ids, 1, block_index), 0)
        else:  # a page in every group
            groups = model.page_groups.count
            pages = torch.gather(seq_block_ids, 2, block_index.unsqueeze(1).expand(n, groups, t))
            write_page = torch.where(live.unsqueeze(1), pages, 0)
        write_slot = positions % stride
        # Which cached keys each query may see: real (< seq_len) and not in its future,
        # as an additive float bias built by integer arithmetic: a boolean mask would
        # reach the attention matmul's data-tiled layout as i1, which IREE cannot pack.
        key_pos = torch.arange(blocks * stride).view(1, 1, -1)
        last_key = seq_lens.view(n, 1) - 1
        last_visible = (torch.minimum(positions, last_key) if model.causal else last_key.expand(n, t)).unsqueeze(-1)
        hidden = (key_pos - last_visible).clamp(0, 1)  # [N,T,B*stride]: 1 = may not look
        bias = (hidden.float() * MASKED_SCORE).unsqueeze(1)  # [N,1,T,B*stride]
        # The same for a one-token step as a count: its query sees the first `visible` keys.
        visible = torch.clamp(last_visible[:, 0, 0] + 1, min=0, max=blocks * stride)  # [N]
        local = None
        if SLIDING in model.config.layer_types:
            # A local layer's query also may not look at keys `sliding_window` or more behind it.
            too_old = (positions.unsqueeze(-1) - model.config.sliding_window + 1 - key_pos).clamp(0, 1)
            local_bias = ((hidden + too_old).clamp(0, 1).float() * MASKED_SCORE).unsqueeze(1)
            local_rotary = (cos, sin) if model.local_inv_freq is None else model.rotary(positions, dtype, seq_lens, local=True)
            local = (*local_rotary, local_bias)
        return cls(cos, sin, write_page, write_slot, bias, visible, seq_block_ids, stride, local, model.page_groups)

    def moved(self, move) -> "PagedStep":
        """The same step with every tensor passed through `move` (a transfer to a device)."""
        local = None if self.local is None else tuple(move(x) for x in self.local)
        return PagedStep(*(move(x) for x in (self.cos, self.sin, self.write_page, self.write_slot, self.bias,
                                              self.visible, self.seq_block_ids)), self.stride, local, self.groups)


class CachePages:
    """One cache buffer's pages: `layers` layers of `kv_heads` heads each, in the page layout the
    module docstring gives. One device's share of a multi-device export is the same layout over
    its own layers and heads.

    One head's block of a layer holds K transposed, [D, stride], and V as [stride, D]. Blocks are
    gathered whole. K^T blocks laid side by side are the data-tiled layout of the scores matmul's
    right operand on llvm-cpu (16 keys per tile), so that gather is a plain copy; stored as
    [stride, D], each block was transposed element by element on the way.

    A byte cache's page (int8 or fp8 values, models/kv_quant.py) ends in scale blocks: the scales of
    its value block i, 2 bytes a token, are row i of them viewed [?, 2 * stride]. The pages are
    handled as int8 bytes whatever the format; `format` says how the values decode. Scales are kept
    apart from the values so both are gathered whole: values sliced out of a gathered block fused
    into the attention matmul's producer, which IREE 3.13's llvm-cpu code generation rejects ("no
    basis element may be statically non-positive"). The scales apply to the scores and to the
    softmax weights, per key.
    """

    def __init__(self, cache: torch.Tensor, layers: int, kv_heads: int, head_dim: int, stride: int):
        self.layers, self.kv_heads, self.head_dim, self.stride = layers, kv_heads, head_dim, stride
        self.format = cache_dtype_name(cache.dtype)
        self.quantized = self.format in kv_quant.QMAX
        self.value_blocks = layers * 2 * kv_heads
        # Blocks of head_dim x stride elements per page, scale blocks included.
        self.page_blocks = self.value_blocks + kv_scale_blocks(self.value_blocks, head_dim, self.format)
        # Byte formats are stored and moved as int8 (torch has no scatter into float8 on the CPU).
        cache = cache.view(torch.int8) if self.quantized else cache
        self.flat = cache.view(-1)
        self.key_pages = cache.view(-1, head_dim, stride)
        self.value_pages = cache.view(-1, stride, head_dim)
        self.head = torch.arange(kv_heads).view(1, kv_heads, 1)
        self.key_dim_offset = (torch.arange(head_dim) * stride).view(1, 1, 1, head_dim)
        if self.quantized:
            self.scale_rows = cache.view(-1, KV_SCALE_BYTES * stride)
            self.value_dim_offset = torch.arange(head_dim).view(1, 1, 1, head_dim)
            self.scale_byte = torch.arange(KV_SCALE_BYTES).view(1, 1, 1, KV_SCALE_BYTES)

    def block_of(self, page, layer: int):
        """The K block of each head of `layer` on pages `page` [N, ...] -> [N, Hkv, ...] (its V block
        is kv_heads blocks later)."""
        return (page * self.page_blocks + layer * 2 * self.kv_heads).unsqueeze(1) + self.head

    def scale_row_of(self, block):
        """The row of scale_rows holding the scales of `block`."""
        page = torch.div(block, self.page_blocks, rounding_mode="floor")
        rows_per_block = self.head_dim // KV_SCALE_BYTES
        return (page * self.page_blocks + self.value_blocks) * rows_per_block + (block - page * self.page_blocks)

    def attend(self, attn: Attention, layer: int, x, step: PagedStep, gather_pages, decode_attention=None):
        """attn's output for normalized input x, after writing its new K/V as layer `layer`; a
        one-token step reads the pages in place through `decode_attention` when one is given."""
        table, write_page, layer = step.pages_of(layer)
        n, blocks = table.shape
        cos, sin, bias = step.view(attn.sliding)
        q, k, v = attn.project(x, cos, sin)
        slot = step.write_slot.unsqueeze(1)  # [N,1,T]
        self.write(self.block_of(write_page, layer), slot, k, v)
        read = self.block_of(table, layer)  # [N,Hkv,B]
        # The in-place decode kernel reads a prefix of the keys with plain scores: local layers'
        # windows and capped scores take the gathered path.
        if decode_attention is not None and q.shape[2] == 1 and not attn.sliding and attn.softcap is None:
            scaled = q[:, :, 0].float() * attn.scale
            # A byte cache's kernel also takes where a page keeps its scales.
            page = (self.page_blocks, self.value_blocks) if self.quantized else ()
            out = decode_attention(scaled, self.key_pages, read, step.visible, *page)  # [N,H,D]
            return attn.o_proj(out.reshape(n, 1, -1).to(q.dtype))
        keys_t, values, scales = self.read(gather_pages, read, n, blocks)
        return attn.attend_paged(q, keys_t, values, bias, self.stride, scales)

    def write(self, key_block, slot, k, v):
        """Store k, v [N,Hkv,T,D] at `slot` [N,1,T] of blocks `key_block` [N,Hkv,T] (K) and
        kv_heads blocks later (V): one K^T column and one V row per token; in a byte cache, as bytes
        with each token's scale in its scale row, in one scatter."""
        head_dim, stride = self.head_dim, self.stride
        value_block = key_block + self.kv_heads
        key_elems = (key_block * (head_dim * stride) + slot).unsqueeze(-1) + self.key_dim_offset  # [N,Hkv,T,D]
        if not self.quantized:
            self.flat.index_put_((key_elems,), k.to(self.flat.dtype))
            self.flat.view(-1, head_dim).index_put_((value_block * stride + slot,), v.to(self.flat.dtype))
            return
        value_elems = ((value_block * stride + slot) * head_dim).unsqueeze(-1) + self.value_dim_offset
        row_bytes = KV_SCALE_BYTES * stride

        def scale_elems(block):  # [N,Hkv,T,2]
            return (self.scale_row_of(block) * row_bytes + slot * KV_SCALE_BYTES).unsqueeze(-1) + self.scale_byte

        (k, k_scale), (v, v_scale) = kv_quant.quantize(k, self.format), kv_quant.quantize(v, self.format)
        elems = torch.cat((key_elems, scale_elems(key_block), value_elems, scale_elems(value_block)), dim=-1)
        self.flat.index_put_((elems,), torch.cat((k, k_scale, v, v_scale), dim=-1))

    def read(self, gather_pages, read, n: int, blocks: int):
        """keys_t [N,Hkv,D,B*stride] and values [N,Hkv,B*stride,D] of the K blocks `read`
        [N,Hkv,B] and their V blocks, gathered; for a byte cache, float32 of its values and the
        scales (K's, V's) of each key [N,Hkv,1,B*stride], else None."""
        kv_heads, head_dim, stride = self.kv_heads, self.head_dim, self.stride
        keys_t = gather_pages(self.key_pages, read).permute(0, 1, 3, 2, 4).reshape(n, kv_heads, head_dim, blocks * stride)
        values = gather_pages(self.value_pages, read + kv_heads).view(n, kv_heads, blocks * stride, head_dim)
        if not self.quantized:
            return keys_t, values, None
        pairs = (n, kv_heads, blocks * stride, KV_SCALE_BYTES)
        scales = tuple(kv_quant.scales(gather_pages(self.scale_rows, self.scale_row_of(block)).view(pairs))
                       .unsqueeze(2) for block in (read, read + kv_heads))
        return kv_quant.values(keys_t, self.format), kv_quant.values(values, self.format), scales
