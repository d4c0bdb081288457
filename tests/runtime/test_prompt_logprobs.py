"""Prompt logprobs (what `echo` with logprobs and lm-eval's loglikelihood need), on the tiny model.

The reference is one whole-prompt prefill through the compiled function: log_softmax of
the logits at position p, read at prompt token p + 1.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kiln.runtime import GenerateService, SamplingParams, ServiceConfig
from kiln.runtime.contract import Artifacts
from kiln.runtime.program import Program
from kiln.runtime.sampling import compute_logprobs, compute_logprobs_rows
from tests.paged_driver import PagedDriver

pytestmark = pytest.mark.e2e

PROMPT = [int(t) for t in np.random.default_rng(7).integers(4, 384, 70)]


@pytest.fixture(scope="module")
def reference(tiny_artifacts):
    """log_softmax rows for PROMPT from one plain prefill."""
    program = Program(Artifacts.in_directory(tiny_artifacts))
    driver = PagedDriver(program)
    seqs = driver.new_sequences(1, len(PROMPT))
    logits = np.asarray(driver.prefill(seqs, [PROMPT], batch=1)[0, : len(PROMPT)], np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


async def prompt_logprobs_of(service, params, request_id=None):
    found = None
    async for event in service.generate(PROMPT, params, request_id=request_id):
        if event.prompt_logprobs is not None:
            assert found is None and event.index == 0, "prompt logprobs come once, with sequence 0"
            found = event.prompt_logprobs
    return found


def check(found, reference, k):
    assert len(found) == len(PROMPT) and found[0] is None
    for position in range(1, len(PROMPT)):
        entry = found[position]
        assert entry.token_id == PROMPT[position]
        assert entry.logprob == pytest.approx(reference[position - 1, PROMPT[position]], abs=2e-4)
        assert len(entry.top) == k
        best = np.argsort(-reference[position - 1], kind="stable")[:k]
        assert list(entry.top.values()) == sorted(entry.top.values(), reverse=True)
        assert set(entry.top) == {int(i) for i in best}


@pytest.mark.parametrize("prefix_sharing", ["trie", "none"])
def test_prompt_logprobs_match_a_plain_prefill(tiny_artifacts, reference, prefix_sharing):
    async def scenario():
        # A 32-token chunk size cuts the 70-token prompt into three prefill steps.
        config = ServiceConfig(Artifacts.in_directory(tiny_artifacts), prefix_sharing=prefix_sharing, chunk_tokens=32)
        service = await GenerateService(config).start()
        try:
            plain = SamplingParams(max_tokens=2, temperature=0)
            async for _ in service.generate(PROMPT, plain):  # leaves the prompt in the prefix cache
                pass
            params = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2, n=2)
            check(await prompt_logprobs_of(service, params), reference, 2)
            # Without the flag nothing is computed or sent.
            assert await prompt_logprobs_of(service, plain) is None
            service.cache.check_integrity()
            assert service.cache.stats().active == 0
        finally:
            await service.stop(0)

    asyncio.run(scenario())


def test_rows_match_the_single_row_function():
    logits = np.random.default_rng(0).normal(size=(5, 40)).astype(np.float32)
    targets = [3, 0, 39, 7, 7]
    for (logprob, top), row, target in zip(compute_logprobs_rows(logits, targets, 4), logits, targets):
        want_logprob, want_top = compute_logprobs(row, target, 4)
        assert logprob == pytest.approx(want_logprob, abs=1e-5)
        assert list(top) == list(want_top)
    assert compute_logprobs_rows(logits, targets, 0)[0][1] == {}


def test_prompt_logprobs_are_validated():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1).validate()
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21).validate()
