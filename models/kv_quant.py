"""The int8 KV cache's numbers: each token's K (or V) vector of one head stored as int8 with one
scale, symmetric (value = q * scale, q in [-127, 127]).

A scale per token rather than one per page: a page fills a token at a time during decode, and a
page-wide scale would have to be fixed before its later tokens are seen, or their earlier
neighbours re-rounded each time a larger one arrived. A page keeps the scales of its K and V
blocks in scale blocks after them (models/llama.py's CachePages, runtime/config.py's
kv_scale_blocks), so a page, whatever tier it is copied to, carries its own scales.

A scale is stored as the bit pattern of a positive bfloat16 (two bytes, little-endian): the CPU
attention kernel widens it to float32 with one shift, and the export computes it with integer
arithmetic alone (torch has no bit cast IREE takes). It is rounded up, so no value clips.
"""

from __future__ import annotations

import torch

QMAX = 127
# The smallest scale written: an all-zero vector (padding, page 0) still gets a finite one.
MIN_SCALE = 2.0**-100


def encode_scale(absmax: torch.Tensor) -> torch.Tensor:
    """The bfloat16 bit pattern (int64, 0..32767) of the smallest bfloat16 scale >= absmax / QMAX."""
    scale = torch.clamp(absmax.float() / QMAX, min=MIN_SCALE)
    exponent = torch.floor(torch.log2(scale))
    # Seven mantissa bits, rounded up; 128 carries into the exponent field, as a bit pattern does.
    mantissa = torch.clamp(torch.ceil((scale / torch.exp2(exponent) - 1.0) * 128.0), 0, 128)
    return (exponent.to(torch.int64) + 127) * 128 + mantissa.to(torch.int64)


def decode_scale(code: torch.Tensor) -> torch.Tensor:
    """float32 scales of bfloat16 bit patterns (any integer type)."""
    code = code.to(torch.int64)
    exponent = torch.div(code, 128, rounding_mode="floor") - 127
    mantissa = code - torch.div(code, 128, rounding_mode="floor") * 128
    return (1.0 + mantissa.float() / 128.0) * torch.exp2(exponent.float())


def code_bytes(code: torch.Tensor) -> torch.Tensor:
    """[..., 2] int8: a 16-bit code's low byte, then its high byte (little-endian, as C reads it)."""
    high = torch.div(code, 256, rounding_mode="floor")
    low = code - high * 256  # 0..255, stored as int8's two's complement
    low = low - (low > 127).to(torch.int64) * 256
    return torch.stack((low, high), dim=-1).to(torch.int8)


def bytes_code(pairs: torch.Tensor) -> torch.Tensor:
    """The 16-bit codes of [..., 2] int8 (low byte, high byte): int64 [...]."""
    low, high = pairs[..., 0].to(torch.int64), pairs[..., 1].to(torch.int64)
    return high * 256 + low + (low < 0).to(torch.int64) * 256


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (int8 values [..., D], int8 scale bytes [..., 2]), one scale per vector."""
    code = encode_scale(x.float().abs().amax(dim=-1))
    scale = decode_scale(code).unsqueeze(-1)
    values = torch.clamp(torch.round(x.float() / scale), -QMAX, QMAX).to(torch.int8)
    return values, code_bytes(code)


def scales(pairs: torch.Tensor) -> torch.Tensor:
    """float32 scales [...] of scale bytes [..., 2]."""
    return decode_scale(bytes_code(pairs))
