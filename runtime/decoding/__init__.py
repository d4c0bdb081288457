"""Plain decoding: one token per step for each sequence, sampled from its last logits."""

from .mode import PlainDecoding, autoregressive_footprint

__all__ = ["PlainDecoding", "autoregressive_footprint"]
