"""benchmarks/kv_cache_bench.py's figures on the tiny model's float32, int8 and fp8 caches: the
prompt's own tokens scored, finite and near each other; decode tokens/s counted."""

from __future__ import annotations

import math

import pytest

from benchmarks.kv_cache_bench import decode_tok_s, mean_logprob
from kiln.runtime import LLM

pytestmark = pytest.mark.e2e


def test_the_mean_logprob_of_each_cache(tiny_artifacts, tiny_int8_kv_artifacts, tiny_fp8_kv_artifacts):
    figures = []
    for artifacts in (tiny_artifacts, tiny_int8_kv_artifacts, tiny_fp8_kv_artifacts):
        with LLM(artifacts) as llm:
            figures.append(mean_logprob(llm, tokens=200))
            assert decode_tok_s(llm, 2, context=100, tokens=8, vocab=380) > 0
    assert all(math.isfinite(f) and f < 0 for f in figures)
    assert abs(figures[1] / figures[0] - 1) < 0.01 and abs(figures[2] / figures[0] - 1) < 0.01
