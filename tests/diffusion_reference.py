"""Diffusion generation in torch, eager, one request at a time: the yardstick for Kiln's runtime.

Ported from the upstream algorithms: LLaDA's `generate` (semi-autoregressive blocks,
`get_num_transfer_tokens`, `get_transfer_index` with low_confidence / random remasking,
Gumbel noise, classifier-free guidance), Fast-dLLM's threshold rule and its
`generate_with_prefix_cache` / `generate_with_dual_cache` (a refresh pass at each block
start, then passes over the block, or from the block on, attending to the K/V the refresh
left), and Dream's confidence measures (top-1, margin, negative entropy) and shifted logits.

Where Kiln makes a choice upstream leaves open, this makes the same one, so a difference
is a bug and not a policy: a shifted model's cached window starts one token before the
block (so every block position has the output that predicts it), and generation stops
once the tokens committed without a gap reach a stop token (the text ends there anyway).

The K/V cache here is plain per-layer tensors, as upstream's `past_key_values`; it shares
nothing with Kiln's paged cache but the model's weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from kiln.models.llama import PagedLlama


@dataclass
class ReferenceResult:
    tokens: list[int]  # generated, cut after the first stop token
    forward_passes: int
    committed_per_pass: list[int]


def forward(model: PagedLlama, tokens: torch.Tensor, start: int, end: int, cache=None):
    """Logits [1, end - start, V] for positions start..end of `tokens` [1, L], attending to
    all L positions: K/V of the window computed afresh, the rest taken from `cache` (a
    list of per-layer (K, V) [1, Hkv, L, D], as a full pass returns). Returns (logits, K/V)."""
    window = tokens[:, start:end]
    h = model.model.embed_tokens(window)
    cos, sin = model.rotary(torch.arange(start, end).unsqueeze(0), h.dtype, torch.tensor([tokens.shape[1]]))
    layers_kv = []
    for index, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        q, k, v = attn.project(layer.input_layernorm(h), cos, sin)
        if cache is None:
            keys, values = k, v
        else:
            keys, values = cache[index][0].clone(), cache[index][1].clone()
            keys[:, :, start:end], values[:, :, start:end] = k, v
        layers_kv.append((keys, values))
        h = h + attn.attend(q, keys, values, None)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.logits(h), layers_kv


def num_transfer_tokens(mask_index: torch.Tensor, steps: int) -> torch.Tensor:
    """LLaDA's get_num_transfer_tokens."""
    mask_num = mask_index.sum(dim=1, keepdim=True)
    base, remainder = mask_num // steps, mask_num % steps
    counts = torch.zeros(mask_num.size(0), steps, dtype=torch.int64) + base
    for i in range(mask_num.size(0)):
        counts[i, : remainder[i]] += 1
    return counts


def add_gumbel_noise(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    if temperature == 0:
        return logits
    logits = logits.to(torch.float64)
    noise = torch.rand_like(logits, dtype=torch.float64)
    return logits.exp() / (-torch.log(noise)) ** temperature


def confidence_of(logits: torch.Tensor, x0: torch.Tensor, measure: str) -> torch.Tensor:
    """LLaDA's low_confidence score (top1) and Dream's sample_tokens measures (margin, entropy)."""
    p = F.softmax(logits.to(torch.float64), dim=-1)
    if measure == "top1":
        return torch.gather(p, -1, x0.unsqueeze(-1)).squeeze(-1)
    if measure == "margin":
        top = torch.sort(p, dim=-1, descending=True).values
        return top[..., 0] - top[..., 1]
    if measure == "entropy":
        return torch.sum(p * torch.log(p + 1e-10), dim=-1)
    raise ValueError(measure)


def transfer_index(logits, temperature, remasking, measure, mask_index, x, count, threshold):
    """Fast-dLLM's get_transfer_index, with Dream's confidence measures."""
    x0 = torch.argmax(add_gumbel_noise(logits, temperature), dim=-1)
    if remasking == "low_confidence":
        x0_p = confidence_of(logits, x0, measure)
    elif remasking == "random":
        x0_p = torch.rand(x0.shape, dtype=torch.float64)
    else:
        raise ValueError(remasking)
    x0 = torch.where(mask_index, x0, x)
    confidence = torch.where(mask_index, x0_p, torch.tensor(-np.inf, dtype=torch.float64))
    chosen = torch.zeros_like(x0, dtype=torch.bool)
    k = int(mask_index.sum()) if threshold is not None else int(count)
    _, select = torch.topk(confidence[0], k=k)
    chosen[0, select] = True
    if threshold is not None:
        for j in range(1, k):
            if confidence[0, select[j]] < threshold:
                chosen[0, select[j]] = False
    return x0, chosen


def shifted(logits: torch.Tensor, shift: int) -> torch.Tensor:
    """Dream's logits shift: position i gets the output at i - 1 (the first keeps its own)."""
    return torch.cat([logits[:, :1], logits[:, :-1]], dim=1) if shift else logits


@torch.no_grad()
def generate(model: PagedLlama, prompt: list[int], *, gen_length: int, block_length: int, steps: int,
             mask_id: int, shift: int = 0, temperature: float = 0.0, remasking: str = "low_confidence",
             confidence: str = "top1", threshold: float | None = None, cache: str = "none",
             cfg_scale: float = 0.0, stop_ids=()) -> ReferenceResult:
    prompt_len = len(prompt)
    x = torch.full((1, prompt_len + gen_length), mask_id, dtype=torch.long)
    x[0, :prompt_len] = torch.tensor(prompt)
    length = x.shape[1]
    assert gen_length % block_length == 0
    num_blocks = gen_length // block_length
    assert steps % num_blocks == 0
    steps_per_block = steps // num_blocks
    nfe, committed = 0, []

    def full_pass():
        if cfg_scale:
            un_x = x.clone()
            un_x[0, :prompt_len] = mask_id
            logits, _ = forward(model, x, 0, length)
            un_logits, _ = forward(model, un_x, 0, length)
            return un_logits + (cfg_scale + 1) * (logits - un_logits), None
        return forward(model, x, 0, length)

    def stopped() -> bool:
        generated = x[0, prompt_len:].tolist()
        prefix = generated.index(mask_id) if mask_id in generated else len(generated)
        return any(t in stop_ids for t in generated[:prefix])

    for block in range(num_blocks):
        block_start = prompt_len + block * block_length
        block_end = block_start + block_length
        counts = num_transfer_tokens(x[:, block_start:block_end] == mask_id, steps_per_block)
        kv = None
        i = 0
        while True:
            if cache == "none" or i == 0:
                logits, kv = full_pass()
                window_start = 0
            else:
                window_start = block_start - shift
                window_end = block_end if cache == "dual" else length
                logits, _ = forward(model, x, window_start, window_end, kv)
            logits = shifted(logits, shift)
            logits[..., mask_id] = -np.inf  # as Kiln: a mask is never a prediction
            window = x[:, window_start : window_start + logits.shape[1]]
            mask_index = window == mask_id
            mask_index[:, block_end - window_start :] = False
            count = counts[:, min(i, steps_per_block - 1)] if threshold is None else None
            x0, chosen = transfer_index(logits, temperature, remasking, confidence, mask_index, window, count,
                                        threshold)
            window[chosen] = x0[chosen]
            nfe += 1
            committed.append(int(chosen.sum()))
            i += 1
            if stopped():
                break
            if not (x[:, block_start:block_end] == mask_id).any():
                break
        if stopped():
            break
    generated = x[0, prompt_len:].tolist()
    prefix = generated.index(mask_id) if mask_id in generated else len(generated)
    tokens = generated[:prefix]
    for index, token in enumerate(tokens):
        if token in stop_ids:
            tokens = tokens[: index + 1]
            break
    return ReferenceResult(tokens, nfe, committed)
