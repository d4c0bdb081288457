"""Speculative decoding on the fake program: prompt lookup and a draft model give exactly the
greedy tokens plain decoding gives, keep sampling's distribution, and account pages exactly."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from kiln.runtime import GenerateService, SamplingParams, ServiceConfig, SpeculativeConfig
from kiln.runtime.contract import Artifacts
from kiln.runtime.errors import ModelLoadError
from kiln.runtime.sampling import Sampler, probabilities
from kiln.runtime.speculative.acceptance import accept
from kiln.runtime.speculative.prompt_lookup import PromptLookup
from tests.runtime.test_batcher import assert_idle, settle
from tests.fake_program import VOCAB, FakeProgram, expected_greedy, next_token

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def run(coroutine):
    return asyncio.run(coroutine)


class NoisyDraft(FakeProgram):
    """A draft that agrees with the fake model three times in four: where the model's best
    token is a multiple of 4, its peak sits one id higher."""

    def call(self, name, *args):
        out = super().call(name, *args)
        best = out.argmax(-1)
        shifted = np.roll(out, 1, axis=-1)
        return np.where((best % 4 == 0)[..., None], shifted, out)


def factory(draft_dir=None, draft_class=FakeProgram):
    def make(artifacts, device="local-task", parameter_memory="auto"):
        if draft_dir is not None and artifacts.config.parent == draft_dir:
            return draft_class(artifacts, device, parameter_memory)
        return FakeProgram(artifacts, device, parameter_memory)
    return make


async def started(directory, speculative=None, program_factory=None, **options) -> GenerateService:
    config = ServiceConfig(Artifacts.in_directory(directory), speculative=speculative, **options)
    return await GenerateService(config, program_factory=program_factory or FakeProgram).start()


async def tokens_of(service, prompt, params) -> list[list[int]]:
    outs = [[] for _ in range(params.n)]
    async for event in service.generate(prompt, params):
        outs[event.index] += event.token_ids
    return outs


def repetitive(length, seed):
    """A prompt that repeats a phrase: what prompt lookup drafts from."""
    phrase = [4 + (seed * 37 + i * 11) % 300 for i in range(6)]
    return (phrase * (length // 6 + 1))[:length]


def drafting_with(directory, k: int = 4) -> SpeculativeConfig:
    """A draft model (the export in `directory`) drafting k tokens at every batch width."""
    return SpeculativeConfig("draft_model", k, Artifacts.in_directory(directory), disable_by_batch_size=0)


def copy_of(directory, to):
    """The fake model's artifacts in another directory, so a factory can tell the draft apart."""
    to.mkdir()
    for item in directory.iterdir():
        (to / item.name).write_bytes(item.read_bytes())
    return to


@pytest.fixture(scope="module")
def wide_model_dir(fake_model_dir, tmp_path_factory):
    """The fake model with a decode of 16 rows: room for several sequences' drafts in one verify
    call (a row per token)."""
    from tests.fake_program import write_fake_artifacts

    directory = tmp_path_factory.mktemp("wide")
    write_fake_artifacts(directory, (fake_model_dir / "tokenizer.json").read_text(), decode_sizes=(1, 4, 16),
                         pages=256)
    return directory


def seq_of(params, output=(), prompt=(5, 6), seed=0):
    return SimpleNamespace(params=params, rng=np.random.default_rng(seed), output_ids=list(output),
                           prompt_ids=list(prompt))


# -- the pieces ------------------------------------------------------------------------
def test_prompt_lookup_continues_the_latest_longest_match():
    lookup = PromptLookup(max_ngram=3, min_ngram=1)
    #            0  1  2  3  4  5  6  7  8  9  10
    tokens = [1, 2, 3, 9, 8, 1, 2, 3, 7, 6, 2, 3]
    # "2 3" last occurs at 6..7 (then 7, 6), before that at 1..2 (then 9): the latest wins.
    assert lookup.propose(tokens, 3) == [7, 6, 2]
    assert lookup.propose(tokens, 1) == [7]
    # The 3-gram "1 2 3" is preferred to shorter ones when it recurs.
    assert lookup.propose([1, 2, 3, 4, 5, 0, 1, 2, 3], 2) == [4, 5]
    assert lookup.propose([1, 2, 3, 4], 4) == []  # nothing recurs
    assert lookup.propose([5], 4) == [] and lookup.propose([1, 2, 1], 0) == []
    with pytest.raises(ValueError):
        PromptLookup(1, 2)


def test_greedy_acceptance_keeps_the_agreeing_prefix_then_the_models_token():
    logits = np.full((4, 10), -5.0, np.float32)
    for row, best in enumerate([3, 4, 5, 6]):
        logits[row, best] = 5.0
    sampler, seq = Sampler([1]), seq_of(dataclasses.replace(GREEDY))
    assert [r.token_id for r in accept(sampler, seq, logits, [3, 4, 5])] == [3, 4, 5, 6]  # all kept + bonus
    assert [r.token_id for r in accept(sampler, seq, logits, [3, 9, 5])] == [3, 4]  # corrected at the miss
    assert [r.token_id for r in accept(sampler, seq, logits[:1], [])] == [3]
    # Penalties see the tokens kept before each position: a repetition penalty flips position 1.
    logits[1, 3] = 4.9
    penalised = seq_of(SamplingParams(temperature=0, repetition_penalty=10.0))
    assert [r.token_id for r in accept(sampler, penalised, logits, [3, 3])] == [3, 4]
    # Logprobs are the model's, one per kept token.
    with_logprobs = seq_of(SamplingParams(temperature=0, logprobs=2))
    results = accept(sampler, with_logprobs, logits[2:], [5])
    assert [r.token_id for r in results] == [5, 6] and all(len(r.top_logprobs) == 2 for r in results)


@pytest.mark.parametrize("drafter", ["one-hot", "distribution"])
def test_sampled_acceptance_keeps_the_models_distribution(drafter):
    """Whatever the drafts, the first token follows p: the rejection rule, counted over many draws."""
    logits = np.log(np.array([[0.5, 0.2, 0.15, 0.1, 0.05], [0.2] * 5]), dtype=np.float32)
    params = SamplingParams(temperature=1.0)
    p = probabilities(logits[0], params)
    q_row = np.array([0.1, 0.1, 0.6, 0.1, 0.1])
    draft_rng = np.random.default_rng(7)
    seq = seq_of(params, seed=11)
    counts = np.zeros(5)
    trials = 20000
    for _ in range(trials):
        if drafter == "one-hot":
            draft, probs = [2], None  # prompt lookup: always proposes token 2
        else:
            draft, probs = [int(draft_rng.choice(5, p=q_row))], q_row[None]
        counts[accept(Sampler(), seq, logits, draft, probs)[0].token_id] += 1
    assert np.abs(counts / trials - p).max() < 0.015


# -- the whole loop --------------------------------------------------------------------
PROMPTS = [repetitive(30, 1), repetitive(17, 2), list(range(4, 40)), repetitive(45, 3), [7, 8, 9]]


def test_prompt_lookup_gives_the_greedy_tokens_alone_and_in_a_busy_batch(fake_model_dir):
    async def scenario():
        service = await started(fake_model_dir, SpeculativeConfig("ngram", num_tokens=5, disable_by_batch_size=0))
        expected = [expected_greedy(p, GREEDY.max_tokens) for p in PROMPTS]
        for prompt, want in zip(PROMPTS, expected):
            assert (await tokens_of(service, prompt, GREEDY))[0] == want
        # Together, some opting out: the batch mixes speculating and plain rows.
        params = [GREEDY if i % 2 else dataclasses.replace(GREEDY, speculative=False) for i in range(len(PROMPTS))]
        together = await asyncio.gather(*(tokens_of(service, p, sp) for p, sp in zip(PROMPTS, params)))
        assert [t[0] for t in together] == expected
        counters = service.stats().speculation
        assert counters.steps > 0 and counters.draft_tokens > 0
        assert service.stats().steps["speculate"] == counters.steps
        assert_idle(service)
        await service.stop()

    run(scenario())


def test_drafts_are_verified_through_decode_a_row_per_token(fake_model_dir, tmp_path):
    """The verify call is the decode plain decoding runs (so its kernels and its rounding), the
    drafts cut to the rows the widest decode has: here 4, a sequence and three draft tokens (the
    draft is the model itself: every one is right). An export whose prefill takes no start
    position speculates too."""
    from tests.fake_program import write_fake_artifacts

    whole = write_fake_artifacts(tmp_path / "whole", (fake_model_dir / "tokenizer.json").read_text(),
                                 has_prefill_position=False)

    async def scenario():
        service = await started(whole.config.parent, drafting_with(fake_model_dir, k=5))
        prompt = repetitive(30, 3)
        assert (await tokens_of(service, prompt, GREEDY))[0] == expected_greedy(prompt, GREEDY.max_tokens)
        counters = service.stats().speculation
        assert counters.accepted_tokens == counters.draft_tokens <= 3 * counters.drafts
        assert counters.steps == 6  # the 23 tokens after the prefill's, four a call
        calls = service.program.calls
        assert [call for call in calls if not call.startswith("decode_")] == [calls[0]]  # the prompt's prefill
        assert calls.count("decode_bs4") >= counters.steps
        await service.stop()

    run(scenario())


def test_by_default_only_a_lone_decoding_sequence_is_drafted_for(fake_model_dir):
    async def scenario():
        service = await started(fake_model_dir, SpeculativeConfig("ngram", num_tokens=5))
        outs = await asyncio.gather(*(tokens_of(service, p, GREEDY) for p in PROMPTS[:4]))
        assert [o[0] for o in outs] == [expected_greedy(p, GREEDY.max_tokens) for p in PROMPTS[:4]]
        assert service.speculator.max_rows == 1
        calls = service.program.calls
        assert calls.count("decode_bs4") > 0  # the four decoded together, undrafted
        await tokens_of(service, PROMPTS[0], GREEDY)
        assert service.stats().speculation.steps > 0  # alone, it is drafted for
        await service.stop()

    run(scenario())


def test_a_draft_model_identical_to_the_target_is_always_right(fake_model_dir, wide_model_dir):
    async def scenario():
        service = await started(wide_model_dir, drafting_with(fake_model_dir))
        outs = await asyncio.gather(*(tokens_of(service, p, GREEDY) for p in PROMPTS))
        assert [o[0] for o in outs] == [expected_greedy(p, GREEDY.max_tokens) for p in PROMPTS]
        counters = service.stats().speculation
        assert counters.accepted_tokens == counters.draft_tokens > 0
        # Five rows share the widest decode's 16: two or three drafts each (four alone), + 1.
        assert counters.mean_accepted_length > 3
        assert_idle(service)
        await service.stop()

    run(scenario())


def test_a_draft_model_that_is_sometimes_wrong_changes_nothing_and_leaks_nothing(fake_model_dir, tmp_path):
    draft_dir = copy_of(fake_model_dir, tmp_path / "draft")

    async def scenario():
        spec = SpeculativeConfig("draft_model", num_tokens=3, draft=Artifacts.in_directory(draft_dir),
                                 disable_by_batch_size=0)
        # A small pool: preemption and draft-page growth under pressure.
        service = await started(fake_model_dir, spec, factory(draft_dir, NoisyDraft), page_count=40)
        prompts = PROMPTS + [repetitive(60, s) for s in range(4, 8)]
        outs = await asyncio.gather(*(tokens_of(service, p, GREEDY) for p in prompts))
        assert [o[0] for o in outs] == [expected_greedy(p, GREEDY.max_tokens) for p in prompts]
        counters = service.stats().speculation
        assert 0 < counters.accepted_tokens < counters.draft_tokens
        assert_idle(service)
        # Finished sequences' draft pages go back at the next round.
        await tokens_of(service, [9, 9, 9], GREEDY)
        drafter = service.speculator.draft_model
        drafter.cache.check_integrity()
        assert drafter.cache.stats().active <= drafter.cache.pages_for(3 + GREEDY.max_tokens + 3)
        await service.stop()

    run(scenario())


def test_aborts_mid_speculation_return_every_page(fake_model_dir):
    async def scenario():
        service = await started(fake_model_dir, drafting_with(fake_model_dir))
        long = SamplingParams(max_tokens=150, temperature=0, ignore_eos=True)

        async def abandon(prompt):
            async for event in service.generate(prompt, long):
                if len(event.token_ids) and event.index == 0:
                    break

        await asyncio.gather(*(abandon(p) for p in PROMPTS))
        await settle(service)
        await service.stop()

    run(scenario())


def test_sampling_with_drafts_follows_the_models_distribution(fake_model_dir, wide_model_dir, tmp_path):
    """Every token the fake model samples at temperature 1 sits at an offset from its greedy
    token with probability proportional to exp(-|offset|), with drafts or without."""
    draft_dir = copy_of(fake_model_dir, tmp_path / "draft")
    offsets_p = {0: 0.0, 1: 0.0, -1: 0.0, 2: 0.0, -2: 0.0}
    weights = np.exp(-np.abs(np.arange(-20, 21)))
    for offset in offsets_p:
        offsets_p[offset] = float(weights[offset + 20] / weights.sum())

    async def offsets(spec, program_factory):
        service = await started(wide_model_dir, spec, program_factory)
        found, outs = [], []
        params = [SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True, seed=s) for s in range(200)]
        prompts = [repetitive(12 + s % 7, s) for s in range(200)]
        for group in range(0, 200, 4):  # four rows and their drafts in the widest decode: all may draft
            outs += await asyncio.gather(*(tokens_of(service, p, sp) for p, sp in
                                           zip(prompts[group : group + 4], params[group : group + 4])))
        for prompt, out in zip(prompts, outs):
            tokens = list(prompt)
            for token in out[0]:
                best = next_token(tokens)
                if 20 <= best < VOCAB - 20:  # away from the vocabulary's edges, where the tails are cut
                    found.append(token - best)
                tokens.append(token)
        stats = service.stats().speculation
        assert_idle(service)
        await service.stop()
        return np.array(found), stats

    async def scenario():
        draft = Artifacts.in_directory(draft_dir)
        for spec in (SpeculativeConfig("ngram", 4, disable_by_batch_size=0),
                     SpeculativeConfig("draft_model", 4, draft, disable_by_batch_size=0)):
            found, stats = await offsets(spec, factory(draft_dir, NoisyDraft))
            # Prompt lookup's drafts are mostly refused here (the fake's text never repeats): its
            # rejections are what this checks; the draft model's are mostly kept.
            assert stats.draft_tokens > (500 if spec.draft else 20)
            assert stats.accepted_tokens > (stats.draft_tokens // 2 if spec.draft else -1)
            for offset, p in offsets_p.items():
                assert abs(np.mean(found == offset) - p) < 0.04, (spec.method, offset, np.mean(found == offset), p)

    run(scenario())


def test_speculation_is_refused_where_it_cannot_work(fake_model_dir, tmp_path):
    from tests.fake_program import write_fake_artifacts

    one_row = write_fake_artifacts(tmp_path / "one-row", (fake_model_dir / "tokenizer.json").read_text(),
                                   decode_sizes=(1,))

    async def scenario():
        with pytest.raises(ModelLoadError, match="widest decode has one row"):
            await started(one_row.config.parent, SpeculativeConfig("ngram"))
        short = write_fake_artifacts(tmp_path / "short", (fake_model_dir / "tokenizer.json").read_text(),
                                     max_seq_len=64)
        with pytest.raises(ModelLoadError, match="context"):
            await started(fake_model_dir, SpeculativeConfig("draft_model", draft=short))
    run(scenario())
    with pytest.raises(ValueError):
        SpeculativeConfig("ngram", num_tokens=0)
    with pytest.raises(ValueError):
        SpeculativeConfig("draft_model")
    with pytest.raises(Exception, match="speculative must be a bool"):
        SamplingParams(speculative="yes").validate()
