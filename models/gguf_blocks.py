"""llama.cpp's block-quantized weight types read as int8 values with a float32 scale, and an offset
for the types with a block minimum, per block of input channels: the form Kiln's block-quantized
matmuls take (models/quantize.py).

Each block holds consecutive input channels of one output row: 32 for every type here but Q6_K,
whose sub-blocks are 16. Q8_0 stores int8 values and a float16 scale d (value = d * q); Q4_0
and Q5_0 store 4- and 5-bit q and d (value = d * (q - 8) or d * (q - 16)); Q4_1 and Q5_1 also a
float16 offset m (value = d * q + m). The k-quants group blocks into super-blocks of 256 under
a float16 d (and dmin) with a 6- or 8-bit scale (and minimum) per block: Q4_K and Q5_K
(value = d * sc * q - dmin * mn), Q6_K (value = d * sc * (q - 32)). Here each block's scale is
d * sc and its offset -dmin * mn, which float32 holds exactly (an 11-bit by 6-bit product).

The values sit one per int8 here, so a 4-bit weight takes Q8_0's bytes (twice the file's) and
runs through the same int8 matmul: on this CPU IREE's 4-bit kernel was no faster than its int8
one (benchmarks/NOTES.md). Where Kiln's own CPU kernel serves the one-token products, the 4-bit
types are packed two a byte again (models/quantize.py's `pack_nibbles`). What
`BlockWeight.dequantized` gives equals gguf-py's dequantization bit for bit: the same float32
arithmetic on the same values.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BLOCK = 32  # input channels per block (ggml's QK8_0, QK4_0, ...; a k-quant's sub-block)
SUPER_BLOCK = 256  # a k-quant's super-block (ggml's QK_K)
# Bytes per block (per super-block for the k-quants).
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
BLOCK_TYPES = tuple(BLOCK_BYTES)


@dataclass
class BlockWeight:
    """A [N, K] weight in blocks of `block` input channels: int8 values [N, K], float32 scales
    [K / block, N] (block-major, as the decode matmul reads them), and float32 offsets of the same
    shape for a type with a block minimum, else None."""

    values: np.ndarray
    scales: np.ndarray
    offsets: np.ndarray | None = None
    type_name: str = "Q8_0"  # the GGUF type the blocks were read as

    @property
    def block(self) -> int:
        return self.values.shape[1] // self.scales.shape[0]

    def dequantized(self) -> np.ndarray:
        n, k = self.values.shape
        blocks = self.values.reshape(n, k // self.block, self.block).astype(np.float32) * self.scales.T[..., None]
        if self.offsets is not None:
            blocks = blocks + self.offsets.T[..., None]
        return blocks.reshape(n, k)

    def rows(self, start: int, stop: int) -> "BlockWeight":
        """Output rows start..stop of the weight (a part of a fused projection)."""
        offsets = None if self.offsets is None else np.ascontiguousarray(self.offsets[:, start:stop])
        return BlockWeight(np.ascontiguousarray(self.values[start:stop]),
                           np.ascontiguousarray(self.scales[:, start:stop]), offsets, self.type_name)

    def rows_permuted(self, permute) -> "BlockWeight":
        """The same weight with its output rows reordered by `permute` (a function of a [N, ...]
        array), as the GGUF loader reorders q/k rows."""
        offsets = None if self.offsets is None else np.ascontiguousarray(permute(self.offsets.T).T)
        return BlockWeight(np.ascontiguousarray(permute(self.values)), np.ascontiguousarray(permute(self.scales.T).T),
                           offsets, self.type_name)


def _half(raw: np.ndarray) -> np.ndarray:
    """float16 values [..., 2 bytes] as float32 [...]."""
    return raw.copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] values: byte j's low nibble is value j, its high one j + 16."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _fifth_bits(raw: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's high bits: [..., 4] bytes (a little-endian uint32) -> [..., 32] values of 16 or 0."""
    return np.unpackbits(raw, axis=-1, bitorder="little") << 4


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes per super-block -> 8 six-bit scales and 8 six-bit minimums."""
    d, m, both = (packed[..., i * 4:(i + 1) * 4] for i in range(3))
    scales = np.concatenate([d & 0x3F, (both & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    minimums = np.concatenate([m & 0x3F, (both >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return scales.astype(np.float32), minimums.astype(np.float32)


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 128 bytes per super-block -> 8 blocks of 32: bytes 32j..32j+31 hold block 2j in
    their low nibbles and block 2j + 1 in their high ones."""
    chunks = qs.reshape(*qs.shape[:-1], 4, 32)
    return np.stack([chunks & 0x0F, chunks >> 4], axis=-2).reshape(*qs.shape[:-1], 8, 32)


def _decode(blocks: np.ndarray, type_name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """[rows, blocks, bytes] -> values [rows, sub-blocks, block], scales and offsets [rows, sub-blocks]."""
    if type_name == "Q8_0":
        return blocks[..., 2:].copy().view(np.int8), _half(blocks[..., :2]), None
    if type_name in ("Q4_0", "Q4_1"):
        values = _nibbles(blocks[..., -16:]).astype(np.int16)
        if type_name == "Q4_0":
            return values - 8, _half(blocks[..., :2]), None
        return values, _half(blocks[..., :2]), _half(blocks[..., 2:4])
    if type_name in ("Q5_0", "Q5_1"):
        high = 2 if type_name == "Q5_0" else 4
        values = (_nibbles(blocks[..., -16:]) | _fifth_bits(blocks[..., high:high + 4])).astype(np.int16)
        if type_name == "Q5_0":
            return values - 16, _half(blocks[..., :2]), None
        return values, _half(blocks[..., :2]), _half(blocks[..., 2:4])
    rows, supers = blocks.shape[:2]
    if type_name in ("Q4_K", "Q5_K"):
        d, dmin = _half(blocks[..., :2])[..., None], _half(blocks[..., 2:4])[..., None]
        scales, minimums = _k_scales(blocks[..., 4:16])
        values = _k_low_nibbles(blocks[..., -128:])
        if type_name == "Q5_K":  # bit j of byte i is the fifth bit of value i of block j
            bits = np.unpackbits(blocks[..., 16:48], axis=-1, bitorder="little").reshape(rows, supers, 32, 8)
            values = values | (np.swapaxes(bits, -1, -2) << 4)
        return (values.astype(np.int16).reshape(rows, supers * 8, 32), (d * scales).reshape(rows, -1),
                (-(dmin * minimums)).reshape(rows, -1))
    # Q6_K: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, float16 d. Each half
    # super-block (128 values) takes 64 low-nibble bytes and 32 high-pair bytes.
    low = blocks[..., :128].reshape(rows, supers, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)
    low = (low & 0x0F).reshape(rows, supers, 2, 4, 32)
    high = blocks[..., 128:192].reshape(rows, supers, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
    high = (high & 0x03).reshape(rows, supers, 2, 4, 32)
    values = (low | (high << 4)).astype(np.int16) - 32
    scales = blocks[..., 192:208].copy().view(np.int8).astype(np.float32) * _half(blocks[..., 208:210])[..., None]
    return values.reshape(rows, supers * 16, 16), scales.reshape(rows, -1), None


def read_blocks(raw: np.ndarray, type_name: str, rows: int, columns: int) -> BlockWeight:
    """The blocks of a [rows, columns] tensor stored as `type_name` (one of BLOCK_TYPES), from its
    raw bytes in file order (row by row, each row's blocks in order)."""
    per_block = SUPER_BLOCK if type_name.endswith("_K") else BLOCK
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(rows, columns // per_block, BLOCK_BYTES[type_name])
    values, scales, offsets = _decode(blocks, type_name)
    return BlockWeight(values.astype(np.int8).reshape(rows, columns), np.ascontiguousarray(scales.T),
                       None if offsets is None else np.ascontiguousarray(offsets.T), type_name)


def quantize_blocks(weight: np.ndarray, type_name: str) -> BlockWeight:
    """A float [N, K] weight (K a multiple of BLOCK) quantized as llama.cpp quantizes `type_name`
    (gguf-py's reference quantizer: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1), in this module's form."""
    from gguf import GGMLQuantizationType, quants

    weight = np.ascontiguousarray(weight, dtype=np.float32)
    raw = quants.quantize(weight, GGMLQuantizationType[type_name])
    return read_blocks(raw, type_name, *weight.shape)
