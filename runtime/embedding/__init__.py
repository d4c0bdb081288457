"""Embeddings as a generation mode: a prompt's hidden states pooled into one vector."""

from .mode import NO_EMBED_FUNCTIONS, Embedding

__all__ = ["NO_EMBED_FUNCTIONS", "Embedding"]
