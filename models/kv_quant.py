"""The byte KV caches' numbers: each token's K (or V) vector of one head stored a byte a value with
one scale, symmetric (value = q * scale): int8 (q in [-127, 127]) or fp8 e4m3 (OCP's e4m3fn, |q| <=
448, torch.float8_e4m3fn's bits).

A scale per token rather than one per page: a page fills a token at a time during decode, and a
page-wide scale would have to be fixed before its later tokens are seen, or their earlier
neighbours re-rounded each time a larger one arrived. A page keeps the scales of its K and V
blocks in scale blocks after them (models/llama.py's CachePages, runtime/config.py's
kv_scale_blocks), so a page, whatever tier it is copied to, carries its own scales.

A scale is stored as the bit pattern of a positive bfloat16 (two bytes, little-endian): the CPU
attention kernel widens it to float32 with one shift, and the export computes it with integer
arithmetic alone (torch has no bit cast IREE takes). It is rounded up, so no value clips.

fp8 values are encoded and decoded with plain arithmetic too: IREE 3.13 has no conversion to an
8-bit float for CUDA (nor for OCP's e4m3 on gfx942), and these compile for every target and give
the bits torch's own conversion gives (round to nearest even, tested).
"""

from __future__ import annotations

import torch

# The largest value of each format's bytes: its scale is absmax / QMAX[format].
QMAX = {"int8": 127, "fp8_e4m3": 448}
# The smallest scale written: an all-zero vector (padding, page 0) still gets a finite one.
MIN_SCALE = 2.0**-100


def encode_scale(absmax: torch.Tensor, qmax: float) -> torch.Tensor:
    """The bfloat16 bit pattern (int64, 0..32767) of the smallest bfloat16 scale >= absmax / qmax."""
    scale = torch.clamp(absmax.float() / qmax, min=MIN_SCALE)
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


def fp8_bytes(x: torch.Tensor) -> torch.Tensor:
    """e4m3fn bytes (int8) of float32 x, |x| <= 448: exponent floor(log2|x|) but at least -6 (the
    subnormals share -6's step, 2**-9), 3 mantissa bits rounded to nearest even. A mantissa that
    rounds up to 16 carries into the exponent, as a bit pattern does, so a log2 a step off at a power
    of two still gives the right byte."""
    magnitude = x.abs()
    exponent = torch.clamp(torch.floor(torch.log2(magnitude)), min=-6.0)
    mantissa = torch.round(magnitude * torch.exp2(3.0 - exponent))
    code = ((exponent + 6.0) * 8.0 + mantissa).to(torch.int64) + (x < 0).to(torch.int64) * 128
    return (code - (code > 127).to(torch.int64) * 256).to(torch.int8)


def fp8_values(code: torch.Tensor) -> torch.Tensor:
    """float32 of e4m3fn bytes (int8): exponent field e and mantissa m give (8 + m) * 2**(e - 10),
    or m * 2**-9 for e = 0 (the subnormals). Plain arithmetic, no bit cast: a float16 view of the
    bits, fused into the attention matmul that reads the values, failed IREE 3.13's llvm-cpu
    code generation ("no basis element may be statically non-positive")."""
    unsigned = code.to(torch.int32) + (code < 0).to(torch.int32) * 256
    sign = (unsigned >= 128).to(torch.int32)
    bits = unsigned - sign * 128
    exponent = torch.div(bits, 8, rounding_mode="floor")
    mantissa = (bits - exponent * 8).float()
    normal = (exponent > 0).float()
    magnitude = (mantissa + normal * 8.0) * torch.exp2(torch.clamp(exponent, min=1).float() - 10.0)
    return magnitude * (1.0 - 2.0 * sign.float())


def quantize(x: torch.Tensor, fmt: str = "int8") -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (values [..., D] as int8 bytes in format `fmt`, int8 scale bytes [..., 2]), one
    scale per vector."""
    code = encode_scale(x.float().abs().amax(dim=-1), QMAX[fmt])
    scaled = x.float() / decode_scale(code).unsqueeze(-1)
    if fmt == "int8":
        values = torch.clamp(torch.round(scaled), -QMAX[fmt], QMAX[fmt]).to(torch.int8)
    else:
        values = fp8_bytes(torch.clamp(scaled, -QMAX[fmt], QMAX[fmt]))
    return values, code_bytes(code)


def values(code: torch.Tensor, fmt: str = "int8") -> torch.Tensor:
    """float32 of value bytes (int8) in format `fmt`, before their scales."""
    return code.float() if fmt == "int8" else fp8_values(code)


def scales(pairs: torch.Tensor) -> torch.Tensor:
    """float32 scales [...] of scale bytes [..., 2]."""
    return decode_scale(bytes_code(pairs))
