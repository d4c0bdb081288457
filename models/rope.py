"""Rope scalings of Llama 3 and YaRN, and the two layouts of a head's rotary pairs, in one place
(numpy, so torch-free callers can use them).

The model applies the scalings to its rotary frequencies; the GGUF loader and writer store Llama 3's
as the `rope_freqs` tensor llama.cpp reads (each frequency's divisor), YaRN's as its parameters.
The model rotates each dimension with the one half a head away (HF's Llama layout); llama.cpp's
files, and ERNIE's and GLM-4's own checkpoints, pair adjacent dimensions: their q/k rows are
reordered on reading.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def llama3_divisors(inverse_frequencies: np.ndarray, scaling: dict[str, Any]) -> np.ndarray:
    """What each rotary frequency is divided by: 1 for short wavelengths, `factor` for long
    ones, and a smooth blend between them (float64, one per frequency)."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context = float(scaling.get("original_max_position_embeddings", 8192))
    low_wavelen = old_context / low_freq_factor
    high_wavelen = old_context / high_freq_factor
    divisors = []
    for frequency in np.asarray(inverse_frequencies, dtype=np.float64):
        wavelen = 2 * math.pi / frequency
        if wavelen < high_wavelen:
            divisors.append(1.0)
        elif wavelen > low_wavelen:
            divisors.append(factor)
        else:
            smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(divisors, dtype=np.float64)


def yarn_frequencies(theta: float, dim: int, scaling: dict[str, Any],
                     max_position_embeddings: int) -> tuple[np.ndarray, float]:
    """YaRN's rotary frequencies for `dim` rotated dimensions, and the factor cos and sin are scaled
    by, as transformers computes both: a frequency whose wavelength is long against the original
    context is interpolated (divided by `factor`), a short one kept as trained, and those between
    ramped (the ramp bounded by `beta_fast` and `beta_slow` rotations over the original context)."""
    original = float(scaling.get("original_max_position_embeddings") or max_position_embeddings)
    factor = float(scaling.get("factor") or max_position_embeddings / original)

    def mscale(scale: float, multiplier: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * multiplier * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        given, all_dims = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(factor, given) / mscale(factor, all_dims) if given and all_dims else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = correction_dim(float(scaling.get("beta_fast") or 32))
    high = correction_dim(float(scaling.get("beta_slow") or 1))
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    kept = 1.0 - np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    trained = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    return trained / factor * (1 - kept) + trained * kept, float(attention)


def unpermute_qk(w: np.ndarray, n_head: int, rotary: int | None = None) -> np.ndarray:
    """q_proj/k_proj rows (weights or biases, `n_head` heads) with each head's rotary pairs adjacent
    (x0, x1: llama.cpp's layout, and ERNIE's and GLM-4's) reordered to the two halves apart (HF's
    Llama layout); `rotary`: how many leading dimensions of a head rotate (the rest stay as they are)."""
    return _reordered(w, n_head, rotary, unpermute=True)


def permute_qk(w: np.ndarray, n_head: int, rotary: int | None = None) -> np.ndarray:
    """unpermute_qk's inverse: convert_hf_to_gguf's `permute` (HF layout -> adjacent pairs)."""
    return _reordered(w, n_head, rotary, unpermute=False)


def _reordered(w: np.ndarray, n_head: int, rotary: int | None, unpermute: bool) -> np.ndarray:
    head_dim = w.shape[0] // n_head
    rotary = rotary or head_dim
    heads = w.reshape(n_head, head_dim, *w.shape[1:])
    part = heads[:, :rotary].reshape(n_head, *((rotary // 2, 2) if unpermute else (2, rotary // 2)), *w.shape[1:])
    part = part.swapaxes(1, 2).reshape(n_head, rotary, *w.shape[1:])
    if rotary == head_dim:
        return part.reshape(w.shape)
    return np.concatenate((part, heads[:, rotary:]), axis=1).reshape(w.shape)
