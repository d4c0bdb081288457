"""A Llama-family decoder in plain torch, over a paged KV cache.

Read it top to bottom: RMSNorm, rotary embeddings, grouped-query attention,
SwiGLU. `forward_paged` is what the export traces (prefill and decode are the
same function with T new tokens at `start_pos`); `forward_reference` is a plain
pass with no cache, the yardstick for the tests. A diffusion LM (LLaDA, Dream) is the
same math without the causal mask: every position sees every other one.

Cache layout (the export/runtime contract, docs/abi.md): `cache[pages, page_elems]`,
each page `[layers, 2 (k, v), kv_heads, block_seq_stride * head_dim]`: a K block is stored
transposed, `[head_dim, block_seq_stride]`, a V block as `[block_seq_stride, head_dim]`
(see forward_paged for why). Only the model reads inside a page; the runtime counts pages.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import LlamaConfig
from .quantize import QuantizedEmbedding, stacked_linear
from .rope import llama3_divisors

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


def rope_inverse_frequencies(config: LlamaConfig) -> torch.Tensor:
    """Per-pair rotation speeds, with Llama-3's frequency-dependent scaling if configured."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type == "llama3":
        inv_freq = inv_freq / torch.from_numpy(llama3_divisors(inv_freq.numpy(), scaling))
    elif rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type not in (None, "default"):
        raise ValueError(f"unsupported rope scaling type {rope_type!r}")
    return inv_freq.float()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, config.hidden_size, bias=False)

    def project(self, x, cos, sin):
        """q [N,H,T,D] and k, v [N,Hkv,T,D] for x [N,T,hidden], rotary applied to q and k."""
        n, t, _ = x.shape
        projections = (self.q_proj, self.k_proj, self.v_proj)
        if t == 1:
            # Decode: one matmul over the three weights (the compiler concatenates them
            # once, at load): two dispatches fewer per layer, ~1 ms of a batch-1 step here.
            # Prefill keeps three: splitting the fused result made its rotary pass slower
            # than the merge saved (benchmarks/NOTES.md).
            sizes = [p.weight.shape[0] for p in projections]
            q, k, v = stacked_linear(projections, x).split(sizes, dim=-1)
        else:
            q, k, v = (p(x) for p in projections)
        q = q.reshape(n, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.reshape(n, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.reshape(n, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return q, k, v

    def attend(self, q, k, v, mask):
        """SDPA with grouped-query heads; mask is boolean [N,1,T,S] (True = may attend)."""
        group = self.n_heads // self.n_kv_heads
        if group > 1:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        n, _, t, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(n, t, self.n_heads * self.head_dim))

    def attend_paged(self, q, keys_t, values, bias, block):
        """Attention over cached pages, written as matmuls and a blocked softmax.

        q [N,H,T,D]; keys_t [N,Hkv,D,S] (transposed); values [N,Hkv,S,D]; bias
        [N,1,T,S] (0 where a query may look, a large negative number elsewhere);
        S is a multiple of `block`. Why not SDPA: IREE lowers it to a fused attention
        op whose llvm-cpu code is ~10x slower than this at 512 tokens, and a softmax
        over one dynamic axis does not vectorize; viewed as [..., S/block, block], the
        static inner axis does. The query heads of a K/V group are stacked into one
        matmul, so K/V are read once per group and never copied.
        """
        n, heads, t, d = q.shape
        kv_heads, s = keys_t.shape[1], keys_t.shape[3]
        group = heads // kv_heads
        dtype = q.dtype
        decode = t == 1
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
        scores = torch.matmul(q, keys_t.float()) * (1.0 / math.sqrt(d))
        scores = scores.view(n, kv_heads, group, rows, s) + bias.view(n, 1, 1, rows, s)
        blocks = scores.view(n, kv_heads, group, rows, s // block, block)
        weights = torch.exp(blocks - blocks.amax(dim=(-2, -1), keepdim=True))
        if decode:
            # Decode normalizes after the product: before it, IREE fuses the division into
            # the matmul and emits a zero-sized `affine.delinearize_index` at T = 1.
            total = weights.sum(dim=(-2, -1)).view(n, kv_heads, group * rows, 1)
            out = torch.matmul(weights.view(n, kv_heads, group * rows, s), values.float()) / total
        else:
            # Prefill normalizes first: after the product, IREE fuses the division into the
            # output projection's data-tiled packing and needs a dynamic stack allocation.
            weights = weights / weights.sum(dim=(-2, -1), keepdim=True)
            out = torch.matmul(weights.view(n, kv_heads, group * rows, s), values.float())
        out = out.view(n, kv_heads, group, rows, d)[:, :, :, :t]
        out = out.permute(0, 3, 1, 2, 4).reshape(n, t, heads * d)
        return self.o_proj(out.to(dtype))


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)


class Backbone(nn.Module):
    """Embeddings, layers and final norm, under HF's `model.` prefix."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


def index_pages(pages: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`pages[index]`: whole pages by index. The export replaces it with IREE's own gather
    (export/page_gather.py), which compiles to a far faster page copy."""
    return pages[index]


class PagedLlama(nn.Module):
    """`gather_pages` copies whole pages by index (`index_pages`'s contract); `decode_attention`,
    when given, is a one-token step's attention reading the pages in place (the contract of
    export/cpu_attention.py's `paged_decode_attention`), used instead of gathering them."""

    def __init__(self, config: LlamaConfig, block_seq_stride: int = 16, gather_pages=index_pages,
                 decode_attention=None):
        super().__init__()
        self.config = config
        self.causal = not config.is_diffusion
        self.block_seq_stride = block_seq_stride
        self.gather_pages = gather_pages
        self.decode_attention = decode_attention
        self.model = Backbone(config)
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # Not a parameter: a small constant folded into the program.
        self.register_buffer("inv_freq", rope_inverse_frequencies(config), persistent=False)

    # -- sizes -------------------------------------------------------------------------
    @property
    def page_elems(self) -> int:
        c = self.config
        return c.num_hidden_layers * 2 * c.num_key_value_heads * self.block_seq_stride * c.head_dim

    def allocate_cache(self, pages: int, dtype=torch.float32) -> torch.Tensor:
        return torch.zeros(pages, self.page_elems, dtype=dtype)

    # -- weights -----------------------------------------------------------------------
    def load_tensors(self, tensors: dict, dtype=torch.float32):
        state = {name: torch.as_tensor(value).to(dtype) for name, value in tensors.items()}
        if self.lm_head is None:
            state.pop("lm_head.weight", None)
        missing, unexpected = self.load_state_dict(state, strict=False)
        missing = [m for m in missing if m != "inv_freq"]
        if missing or unexpected:
            raise ValueError(f"weights do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
        self.to(dtype)
        self.inv_freq = self.inv_freq.float()
        return self

    # -- shared pieces -----------------------------------------------------------------
    def rotary(self, positions: torch.Tensor, dtype):
        """cos, sin [N,1,T,D] for integer positions [N,T]."""
        freqs = positions.unsqueeze(-1).float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        h = self.model.norm(h)
        if self.lm_head is not None:
            return self.lm_head(h).float()
        embedding = self.model.embed_tokens  # tied: the embedding's rows are the output head's
        if isinstance(embedding, QuantizedEmbedding):
            return embedding.project(h)
        return F.linear(h, embedding.weight).float()

    # -- reference: plain attention (causal unless a diffusion LM), no cache -----------
    def forward_reference(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [N,T,V] of a full pass (every row is a whole sequence)."""
        n, t = tokens.shape
        h = self.model.embed_tokens(tokens)
        positions = torch.arange(t).unsqueeze(0).expand(n, t)
        cos, sin = self.rotary(positions, h.dtype)
        mask = torch.ones(t, t, dtype=torch.bool)
        mask = (mask.tril() if self.causal else mask).view(1, 1, t, t)
        for layer in self.model.layers:
            q, k, v = layer.self_attn.project(layer.input_layernorm(h), cos, sin)
            h = h + layer.self_attn.attend(q, k, v, mask)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.logits(h)

    # -- paged: what prefill_bs<N> and decode_bs<N> run --------------------------------
    def forward_paged(
        self,
        tokens: torch.Tensor,  # [N, T] i64
        start_pos: torch.Tensor,  # [N] i64: position of tokens[:, 0]
        seq_lens: torch.Tensor,  # [N] i64: tokens in the sequence once these are written
        seq_block_ids: torch.Tensor,  # [N, B] i64: page of each block of the sequence
        cache: torch.Tensor,  # [pages, page_elems], updated in place
    ) -> torch.Tensor:
        """Hidden states [N,T,hidden] after writing the new K/V into the cache.

        Positions at or past seq_len are padding: their K/V go to page 0, which no
        request owns, so a padded row can never corrupt a live page. A causal model's
        query sees the keys up to its own position; a diffusion LM's sees every key below
        seq_len, the cached ones past the window included (Fast-dLLM's dual cache).
        """
        c = self.config
        h = self.model.embed_tokens(tokens)
        step = PagedStep.of(self, tokens, start_pos, seq_lens, seq_block_ids, h.dtype)
        pages = CachePages(cache, c.num_hidden_layers, c.num_key_value_heads, c.head_dim, self.block_seq_stride)
        for index, layer in enumerate(self.model.layers):
            h = h + pages.attend(layer.self_attn, index, layer.input_layernorm(h), step, self.gather_pages,
                                 self.decode_attention)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return h


class PagedStep:
    """What every layer of one paged call shares: rotary tables, where each new token's K/V go,
    and which cached keys each query may see. Tensors, so a multi-device export can move them."""

    def __init__(self, cos, sin, write_page, write_slot, bias, visible, seq_block_ids, stride: int):
        self.cos, self.sin, self.write_page, self.write_slot = cos, sin, write_page, write_slot
        self.bias, self.visible, self.seq_block_ids, self.stride = bias, visible, seq_block_ids, stride

    @classmethod
    def of(cls, model: "PagedLlama", tokens, start_pos, seq_lens, seq_block_ids, dtype) -> "PagedStep":
        stride = model.block_seq_stride
        n, t = tokens.shape
        blocks = seq_block_ids.shape[1]
        positions = start_pos.unsqueeze(1) + torch.arange(t).unsqueeze(0)  # [N,T]
        cos, sin = model.rotary(positions, dtype)
        # Where each new token's K/V goes: page, slot within the page.
        live = positions < seq_lens.unsqueeze(1)
        block_index = torch.clamp(positions // stride, max=blocks - 1)
        write_page = torch.where(live, torch.gather(seq_block_ids, 1, block_index), 0)
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
        return cls(cos, sin, write_page, write_slot, bias, visible, seq_block_ids, stride)

    def moved(self, move) -> "PagedStep":
        """The same step with every tensor passed through `move` (a transfer to a device)."""
        return PagedStep(*(move(x) for x in (self.cos, self.sin, self.write_page, self.write_slot, self.bias,
                                              self.visible, self.seq_block_ids)), self.stride)


class CachePages:
    """One cache buffer's pages: `layers` layers of `kv_heads` heads each, in the page layout the
    module docstring gives. One device's share of a multi-device export is the same layout over
    its own layers and heads.

    One head's page of a layer holds K transposed, [D, stride], and V as [stride, D]. Pages are
    gathered whole. K^T pages laid side by side are the data-tiled layout of the scores matmul's
    right operand on llvm-cpu (16 keys per tile), so that gather is a plain page copy; stored as
    [stride, D], each page was transposed element by element on the way.
    """

    def __init__(self, cache: torch.Tensor, layers: int, kv_heads: int, head_dim: int, stride: int):
        self.layers, self.kv_heads, self.head_dim, self.stride = layers, kv_heads, head_dim, stride
        self.flat = cache.view(-1)
        self.value_rows = cache.view(-1, head_dim)
        self.key_pages = cache.view(-1, head_dim, stride)
        self.value_pages = cache.view(-1, stride, head_dim)
        self.head = torch.arange(kv_heads).view(1, kv_heads, 1)
        self.key_dim_offset = (torch.arange(head_dim) * stride).view(1, 1, 1, head_dim)

    def attend(self, attn: Attention, layer: int, x, step: PagedStep, gather_pages, decode_attention=None):
        """attn's output for normalized input x, after writing its new K/V as layer `layer`; a
        one-token step reads the pages in place through `decode_attention` when one is given."""
        layers, kv_heads, head_dim, stride = self.layers, self.kv_heads, self.head_dim, self.stride
        n, blocks = step.seq_block_ids.shape
        q, k, v = attn.project(x, step.cos, step.sin)
        slot = step.write_slot.unsqueeze(1)  # [N,1,T]
        key_page = ((step.write_page * layers + layer) * 2).unsqueeze(1) * kv_heads + self.head  # [N,Hkv,T]
        key_elems = (key_page * (head_dim * stride) + slot).unsqueeze(-1) + self.key_dim_offset
        self.flat.index_put_((key_elems,), k.to(self.flat.dtype))  # one column of K^T per token
        value_page = key_page + kv_heads
        self.value_rows.index_put_((value_page * stride + slot,), v.to(self.flat.dtype))  # rows [N,Hkv,T]
        # The K page of each (row, head, block); its V page follows kv_heads pages later.
        read = ((step.seq_block_ids * layers + layer) * 2).unsqueeze(1) * kv_heads + self.head  # [N,Hkv,B]
        if decode_attention is not None and q.shape[2] == 1:
            scaled = q[:, :, 0].float() * (1.0 / math.sqrt(head_dim))
            out = decode_attention(scaled, self.key_pages, read, step.visible)  # [N,H,D]
            return attn.o_proj(out.reshape(n, 1, -1).to(q.dtype))
        keys_t = gather_pages(self.key_pages, read).permute(0, 1, 3, 2, 4).reshape(n, kv_heads, head_dim, blocks * stride)
        values = gather_pages(self.value_pages, read + kv_heads).view(n, kv_heads, blocks * stride, head_dim)
        return attn.attend_paged(q, keys_t, values, step.bias, stride)
