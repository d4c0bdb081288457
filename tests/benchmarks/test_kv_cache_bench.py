"""benchmarks/kv_cache_bench.py's log-probability on the tiny model's float32 and int8 caches:
the prompt's own tokens scored, finite, and near each other."""

from __future__ import annotations

import math

import pytest

from benchmarks.kv_cache_bench import mean_logprob
from kiln.runtime import LLM

pytestmark = pytest.mark.e2e


def test_the_mean_logprob_of_both_caches(tiny_artifacts, tiny_int8_kv_artifacts):
    figures = []
    for artifacts in (tiny_artifacts, tiny_int8_kv_artifacts):
        with LLM(artifacts) as llm:
            figures.append(mean_logprob(llm, tokens=200))
    assert all(math.isfinite(f) and f < 0 for f in figures)
    assert abs(figures[1] / figures[0] - 1) < 0.01
