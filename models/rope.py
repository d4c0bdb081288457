"""Llama-3's frequency-dependent rope scaling, in one place (numpy, so torch-free callers can use it).

The model applies it to its rotary frequencies; the GGUF loader and writer store it as the
`rope_freqs` tensor llama.cpp reads (each frequency's divisor).
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
