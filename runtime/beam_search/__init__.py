"""Beam search: a request's beams step together, each step's best continuations chosen among
them all (`group`: the rule, plain data in and out; `mode`: its place in the batcher's step)."""

from .group import BeamGroup, Choice, Hypothesis
from .mode import BeamSearch

__all__ = ["BeamGroup", "BeamSearch", "Choice", "Hypothesis"]
