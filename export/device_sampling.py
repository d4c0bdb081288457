"""Sampling in the compiled graph: `sample_bs<N>` turns a step's logits into token ids where they
lie, so a GPU step sends back N ids rather than N rows of the vocabulary's logits.

It makes the host sampler's choice (runtime/sampling.py) for a row with nothing but temperature,
top-k, top-p and min-p to apply (no penalties, bias, grammar, logprobs or held-back tokens: the
runtime keeps those rows on the host), from the same one uniform number per token, which the
runtime draws from the row's own generator and passes in. Greedy rows (temperature 0) take the
first most likely token. Other rows keep the k most likely tokens, then the fewest most likely of
those whose weight reaches top_p of theirs, then those of at least min_p times the best one's
weight, and take the token at u of the kept weights' running sum in order of id.

IREE 3.13 compiles neither sort nor top-k for CUDA ("failed to bufferize"), so the k-th largest
score and the nucleus' smallest weight are found by bisection over the floats' bit patterns read
as ordered integers: exact, one count or sum over the vocabulary per bit. Its GPU code also
rejects 64-bit integer reductions ("failed to distribute"): counts and indices reduce in int32,
and the keys' bounds are the keys of float reductions.
Sums run in float32 in another order than numpy's, so a draw within rounding of a boundary
between two tokens may pick the other one.
"""

from __future__ import annotations

import torch

# Bits to bisect: a float32's ordered key spans 2^32 values; a non-negative weight's key lies
# below 0x3F800001 (1.0's), under 2^30.
SCORE_KEY_BITS = 32
WEIGHT_KEY_BITS = 30


def ordered_keys(x: torch.Tensor) -> torch.Tensor:
    """int64 keys ordered as the float32 values x are (-0.0 just below +0.0)."""
    bits = x.view(torch.int32).to(torch.int64)
    return torch.where(bits >= 0, bits, -1 - (bits + 2**31))


def count_int32(mask: torch.Tensor) -> torch.Tensor:
    """[N] each row's count of True in mask [N, V], reduced in int32."""
    return mask.to(torch.int32).sum(dim=-1, dtype=torch.int32)


def kth_largest_key(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """[N] the key of each row's k-th largest value of x [N, V] (k [N] int64, 1..V): the largest
    key τ with at least k keys >= τ. (The bounds come from float reductions: keys are int64.)"""
    keys = ordered_keys(x)
    low, high = ordered_keys(x.amin(dim=-1)), ordered_keys(x.amax(dim=-1))
    for _ in range(SCORE_KEY_BITS):
        middle = low + torch.div(high - low + 1, 2, rounding_mode="floor")
        enough = count_int32(keys >= middle.unsqueeze(-1)) >= k
        low, high = torch.where(enough, middle, low), torch.where(enough, high, middle - 1)
    return low


def nucleus_floor_key(weights: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[N] the key of the smallest weight of each row's nucleus: the largest key τ whose weights
    >= τ sum to at least target [N] (weights [N, V] non-negative, target at most their sum)."""
    keys = ordered_keys(weights)
    low, high = torch.zeros_like(target, dtype=torch.int64), ordered_keys(weights.amax(dim=-1))
    for _ in range(WEIGHT_KEY_BITS):
        middle = low + torch.div(high - low + 1, 2, rounding_mode="floor")
        enough = torch.where(keys >= middle.unsqueeze(-1), weights, 0.0).sum(dim=-1) >= target
        low, high = torch.where(enough, middle, low), torch.where(enough, high, middle - 1)
    return low


def first_max_index(x: torch.Tensor) -> torch.Tensor:
    """[N] int64: the index of each row's first largest value in x [N, V] (numpy's argmax)."""
    ids = torch.arange(x.shape[-1], dtype=torch.int32).expand_as(x)
    first = torch.where(x == x.amax(dim=-1, keepdim=True), ids, x.shape[-1]).amin(dim=-1)
    return first.to(torch.int64)


def inverse_cdf(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """[N] int64: the index at u of each row's running sum of weights [N, V] (non-negative, some
    positive): the first whose running sum passes u times the total, never one of weight 0."""
    running = torch.cumsum(weights, dim=-1)
    index = count_int32(running <= uniform.unsqueeze(-1) * running[:, -1:])
    # Rounding can put the target at or past the total: the last token of positive weight then.
    ids = torch.arange(weights.shape[-1], dtype=torch.int32).expand_as(weights)
    last = torch.where(weights > 0, ids, -1).amax(dim=-1)
    return torch.minimum(index, last).to(torch.int64)


def sample_tokens(logits, temperature, top_k, top_p, min_p, uniform) -> torch.Tensor:
    """Token ids [N] int64 for logits [N, 1, V] (float32) and each row's temperature [N] (0:
    greedy), top_k [N] int64 (< 1: off), top_p, min_p and uniform number [N] (float32). Boolean
    tensors combine through torch.logical_*: IREE's torch input has no lowering for `&` on them."""
    x = logits.reshape(logits.shape[0], logits.shape[-1]).float()
    vocab = x.shape[-1]
    greedy = temperature <= 0
    scaled = x / torch.where(greedy, 1.0, temperature).unsqueeze(-1)
    # Every weight relative to the best token's, which weighs 1 (min-p compares against it).
    weights = torch.exp(scaled - scaled.amax(dim=-1, keepdim=True))
    k = torch.where(torch.logical_and(top_k > 0, top_k < vocab), top_k, vocab)
    weights = torch.where(ordered_keys(scaled) >= kth_largest_key(scaled, k).unsqueeze(-1), weights, 0.0)
    floor = nucleus_floor_key(weights, top_p * weights.sum(dim=-1))
    in_nucleus = torch.logical_or((top_p >= 1.0).unsqueeze(-1), ordered_keys(weights) >= floor.unsqueeze(-1))
    kept = torch.logical_and(in_nucleus, weights >= min_p.unsqueeze(-1))
    drawn = inverse_cdf(torch.where(kept, weights, 0.0), uniform)
    return torch.where(greedy, first_max_index(x), drawn)
