"""Plain decoding: one token per step for each sequence, sampled from its last logits."""

from .device_sampling import DeviceSampling
from .mode import PlainDecoding, autoregressive_footprint

__all__ = ["DeviceSampling", "PlainDecoding", "autoregressive_footprint"]
