"""The compiled sampler's math (export/device_sampling.py), run eagerly in torch: the host sampler's
token for the same logits, settings and uniform number; and which batches the runtime gives it
(runtime/decoding/device_sampling.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.export.device_sampling import sample_tokens
from kiln.runtime.batch import Batch, Phase
from kiln.runtime.contract import Capabilities
from kiln.runtime.decoding import DeviceSampling
from kiln.runtime.request import Request, Sequence
from kiln.runtime.sampling import Sampler, SamplingParams

VOCAB = 384
SETTINGS = [
    dict(temperature=0), dict(temperature=1.0), dict(temperature=0.7, top_k=20), dict(temperature=1.3, top_p=0.9),
    dict(temperature=0.8, top_k=50, top_p=0.8), dict(temperature=1.0, min_p=0.05),
    dict(temperature=0.6, top_p=0.95, min_p=0.1), dict(temperature=1.0, top_k=1000), dict(temperature=2.0, top_p=0.3),
    dict(temperature=0.5, top_k=1),
]


def device_token(logits: np.ndarray, params: SamplingParams, uniform: float) -> int:
    settings = Sampler().device_settings(Sequence(Request([1], params, "r"), 0))
    temperature, top_k, top_p, min_p = settings
    row = [torch.tensor([value], dtype=dtype) for value, dtype in
           ((temperature, torch.float32), (top_k, torch.int64), (top_p, torch.float32), (min_p, torch.float32),
            (uniform, torch.float32))]
    return int(sample_tokens(torch.from_numpy(logits).view(1, 1, -1), *row)[0])


@pytest.mark.parametrize("settings", SETTINGS, ids=[",".join(f"{k}={v}" for k, v in s.items()) for s in SETTINGS])
def test_the_compiled_samplers_math_takes_the_host_samplers_token(settings):
    """Same logits, same seed: the host draws its one number from the generator, the compiled
    sampler is handed the same number, and both walk the kept tokens in order of id."""
    rng = np.random.default_rng(7)
    params = SamplingParams(**settings)
    for trial in range(60):
        logits = (rng.standard_normal(VOCAB) * rng.uniform(0.5, 6)).astype(np.float32)
        if trial % 10 == 0:  # a tie for the best token: the first one, as numpy's argmax
            logits[[3, 90]] = logits.max() + 1
        seed = int(rng.integers(2**31))
        host = Sampler().sample(logits, params, np.random.default_rng(seed)).token_id
        uniform = 0.0 if params.greedy else np.random.default_rng(seed).random()
        assert device_token(logits, params, uniform) == host, (trial, settings)


class FakeSeq:
    """What DeviceSampling reads of a sequence."""

    def __init__(self, mode="decoding", seed=1, output_ids=(), matcher=None, **params):
        self.request = type("R", (), {"mode": mode})()
        self.params = SamplingParams(seed=seed, **params)
        self.rng = np.random.default_rng(seed)
        self.output_ids, self.prompt_ids, self.matcher = list(output_ids), [1], matcher


def decode_batch(rows: int, size: int = 4) -> Batch:
    return Batch(Phase.DECODE, size, tuple(range(rows)), (3,) * rows, ((5,),) * rows, ((1,),) * rows,
                 (True,) * rows, (False,) * rows)


@pytest.fixture
def planner():
    abi = Capabilities(prefill_batch_sizes=(1, 4), decode_batch_sizes=(1, 4), prefill_last_batch_sizes=(1, 4),
                       has_prefill_position=True, prefill_returns_last_only=False, block_seq_stride=16,
                       max_seq_len=256, sample_batch_sizes=(1, 4))
    return DeviceSampling(abi, Sampler(eos_token_ids=[0]))


def test_a_batch_of_plain_rows_is_sampled_on_the_device_drawing_as_the_host_would(planner):
    seqs = [FakeSeq(temperature=0), FakeSeq(seed=5, temperature=0.7, top_k=20, top_p=0.9, min_p=0.01)]
    planned = planner.plan(decode_batch(2), seqs)
    expected_uniform = np.random.default_rng(5).random()
    assert planned.device_sampling == ((0.0, 0, 1.0, 0.0, 0.0), (0.7, 20, 0.9, 0.01, expected_uniform))
    # The greedy row drew nothing; the sampled row drew its one number.
    assert seqs[0].rng.random() == np.random.default_rng(1).random()
    assert seqs[1].rng.random() == np.random.default_rng(5).random(2)[1]


@pytest.mark.parametrize("seq", [
    FakeSeq(temperature=1.0, logprobs=2), FakeSeq(temperature=1.0, presence_penalty=0.5),
    FakeSeq(temperature=1.0, logit_bias={3: 1.0}), FakeSeq(temperature=0, matcher=object()),
    FakeSeq(temperature=1.0, min_tokens=4, max_tokens=8), FakeSeq(mode="beam_search", temperature=0),
], ids=["logprobs", "penalty", "bias", "grammar", "min_tokens", "another mode"])
def test_a_row_only_the_host_can_sample_keeps_the_whole_batch_on_the_host(planner, seq):
    batch = decode_batch(2)
    assert planner.plan(batch, [FakeSeq(temperature=0), seq]) is batch
    assert seq.rng.random() == np.random.default_rng(1).random()  # nothing drawn


def test_batches_the_export_has_no_sampler_for_stay_on_the_host(planner):
    two = decode_batch(2, size=2)  # no sample_bs2
    assert planner.plan(two, [FakeSeq(temperature=0)] * 2) is two
    logprob_prefill = Batch(Phase.PREFILL, 1, (0,), (0,), ((5, 6),), ((1,),), (True,), (True,))
    assert planner.plan(logprob_prefill, [FakeSeq(temperature=0)]) is logprob_prefill
    chunk = Batch(Phase.PREFILL, 1, (0,), (0,), ((5, 6),), ((1,),), (False,), (False,))  # samples nothing
    assert planner.plan(chunk, [FakeSeq(temperature=0)]) is chunk
    prefill = Batch(Phase.PREFILL, 4, (0, 1), (0, 0), ((5, 6), (7,)), ((1,), (2,)), (False, True), (False, False))
    planned = planner.plan(prefill, [FakeSeq(temperature=0), FakeSeq(temperature=0)])
    assert planned.device_sampling == ((0.0, 0, 1.0, 0.0, 0.0),) * 2
