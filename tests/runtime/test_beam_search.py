"""Beam search: the rule against exhaustive search, and the whole loop on the fake program
against an independent beam search over the same logits, with pages shared and freed."""

from __future__ import annotations

import asyncio
import itertools

import numpy as np
import pytest

from kiln.runtime import GenerateService, InvalidRequestError, SamplingParams, ServiceConfig, SpeculativeConfig
from kiln.runtime.beam_search import BeamGroup
from kiln.runtime.contract import Artifacts
from tests.runtime.test_batcher import assert_idle, settle
from tests.fake_program import FakeProgram, _logits

RAMP = np.linspace(0.0, 0.05, 384, dtype=np.float32)  # breaks the fake model's ties (best +- 1 alike)


class TieFreeFake(FakeProgram):
    def call(self, name, *args):
        return super().call(name, *args) + RAMP


def model_logits(prefix) -> np.ndarray:
    return _logits(list(prefix)) + RAMP


def log_softmax(x) -> np.ndarray:
    x = np.asarray(x, np.float64)
    return x - (x.max() + np.log(np.exp(x - x.max()).sum()))


def drive(group: BeamGroup, logits_of, prompt, max_tokens, ends=frozenset()):
    """Run a BeamGroup to the end over `logits_of(prefix)`: what the batcher does, minus pages."""
    slots = [[]]
    while not group.done:
        for slot in range(group.live):
            group.report(slot, logits_of(list(prompt) + slots[slot]))
        choices = group.step(slots[: group.live], ends, max_tokens)
        slots = [slots[c.parent] + [c.token] for c in choices]
    return group


def reference_beams(prompt, width, length):
    """Textbook beam search, no EOS: keep the `width` best prefixes by summed log-probability."""
    beams = [([], 0.0)]
    for _ in range(length):
        expanded = []
        for tokens, score in beams:
            row = log_softmax(model_logits(list(prompt) + tokens))
            expanded += [(tokens + [t], score + float(row[t])) for t in range(row.size)]
        expanded.sort(key=lambda b: -b[1])
        beams = expanded[:width]
    return beams


# -- the rule --------------------------------------------------------------------------
def toy_logits(prefix) -> np.ndarray:
    """A 4-token model whose best continuation is not greedy's."""
    rng = np.random.default_rng(abs(hash(tuple(prefix))) % 2**32)
    return rng.normal(0, 2, 4)


def test_wide_enough_beams_are_an_exhaustive_search():
    length, prompt = 3, [1, 2]
    group = drive(BeamGroup(width=16, length_penalty=1.0), toy_logits, prompt, length)
    scored = []
    for tokens in itertools.product(range(4), repeat=length):
        total = sum(float(log_softmax(toy_logits(prompt + list(tokens[:i])))[tokens[i]]) for i in range(length))
        scored.append((total, list(tokens)))
    scored.sort(key=lambda s: -s[0])
    best = group.ranked(5)
    assert [h.tokens for h in best] == [tokens for _, tokens in scored[:5]]
    assert np.allclose([h.logprob for h in best], [total for total, _ in scored[:5]])
    assert all(h.finish_reason == "length" for h in best)


def test_eos_ends_a_hypothesis_scored_by_its_length():
    # Token 3 is EOS; right after the prompt it is the model's favourite.
    def logits(prefix):
        return np.array([0.0, 0.5, -1.0, 3.0]) if len(prefix) == 2 else np.array([2.0, 0.0, 0.0, -5.0])

    group = drive(BeamGroup(width=2, length_penalty=1.0), logits, [1, 2], 4, ends=frozenset({3}))
    ended = [h for h in group.finished if h.finish_reason == "stop"]
    assert ended and ended[0].tokens == [] and ended[0].stop_token == 3
    lp = log_softmax(logits([1, 2]))[3]
    assert ended[0].score == pytest.approx(lp / 1)  # one token long: the EOS
    # A large length penalty favours the long hypotheses; a negative one the short.
    long_first = drive(BeamGroup(width=2, length_penalty=3.0), logits, [1, 2], 4, ends=frozenset({3})).ranked(1)
    short_first = drive(BeamGroup(width=2, length_penalty=-1.0), logits, [1, 2], 4, ends=frozenset({3})).ranked(1)
    assert len(long_first[0].tokens) == 4 and short_first[0].tokens == []


# -- the whole loop --------------------------------------------------------------------
async def started(directory, **options) -> GenerateService:
    config = ServiceConfig(Artifacts.in_directory(directory), **options)
    return await GenerateService(config, program_factory=TieFreeFake).start()


async def results(service, prompt, params):
    outs = {}
    async for event in service.generate(prompt, params):
        out = outs.setdefault(event.index, {"ids": [], "text": "", "logprob": None, "finish": None})
        out["ids"] += event.token_ids
        out["text"] += event.text
        if event.finish_reason:
            out["finish"], out["logprob"] = event.finish_reason, event.cumulative_logprob
    return [outs[i] for i in sorted(outs)]


BEAMS = SamplingParams(max_tokens=6, num_beams=4, n=3, ignore_eos=True, temperature=0)


@pytest.mark.parametrize("prompt_length", [5, 9])  # a partial last page to fork, or none
def test_beams_equal_a_reference_beam_search_and_share_pages(fake_model_dir, prompt_length):
    prompt = [4 + (i * 13) % 300 for i in range(prompt_length)]

    async def scenario():
        service = await started(fake_model_dir)
        got = await results(service, prompt, BEAMS)
        want = reference_beams(prompt, BEAMS.num_beams, BEAMS.max_tokens)[: BEAMS.n]
        assert [g["ids"] for g in got] == [tokens for tokens, _ in want]
        assert np.allclose([g["logprob"] for g in got], [score for _, score in want], atol=1e-3)
        assert all(g["finish"] == "length" for g in got)
        assert service.cache.stats().hit_tokens > 0  # forks reused their parents' full pages
        assert_idle(service)
        await service.stop()

    run(scenario())


def test_beams_run_beside_ordinary_requests_and_aborts_free_them(fake_model_dir):
    from tests.fake_program import expected_greedy

    prompts = [[4 + (i * 7 + s) % 300 for i in range(6 + s)] for s in range(4)]
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)

    async def scenario():
        service = await started(fake_model_dir, page_count=48)  # tight: preemption among beams and others
        jobs = [results(service, p, greedy) for p in prompts] + [results(service, p, BEAMS) for p in prompts[:2]]
        outs = await asyncio.gather(*jobs)
        assert [o[0]["ids"] for o in outs[:4]] == [expected_greedy(p, 10) for p in prompts]
        for prompt, out in zip(prompts[:2], outs[4:]):
            want = reference_beams(prompt, BEAMS.num_beams, BEAMS.max_tokens)[: BEAMS.n]
            assert [o["ids"] for o in out] == [tokens for tokens, _ in want]
        assert_idle(service)

        async def abandon():
            async for _ in service.generate(prompts[0], SamplingParams(max_tokens=40, num_beams=4, ignore_eos=True)):
                break

        task = asyncio.ensure_future(abandon())
        await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await settle(service)
        await service.stop()

    run(scenario())


def test_what_beam_search_cannot_honour_is_refused(fake_model_dir):
    async def scenario():
        service = await started(fake_model_dir)
        for params, field in ((SamplingParams(num_beams=4, n=5), "n"), (SamplingParams(num_beams=4, stop=["x"]), "stop"),
                              (SamplingParams(num_beams=4, logprobs=1), "logprobs"),
                              (SamplingParams(num_beams=8), "num_beams"),  # wider than the export's decode batch
                              (SamplingParams(num_beams=0), "num_beams")):
            with pytest.raises(InvalidRequestError) as caught:
                service.submit([5, 6, 7], params)
            assert caught.value.param == field
        await service.stop()

    run(scenario())


def run(coroutine):
    return asyncio.run(coroutine)


def test_beam_searches_that_cannot_all_fit_take_turns(fake_model_dir):
    """Two searches whose beams cannot all hold pages at once: neither may wait forever for a
    page the other holds."""
    prompts = [[4 + (i * 7 + s) % 300 for i in range(7)] for s in range(3)]

    async def scenario():
        service = await started(fake_model_dir, page_count=17, prefix_sharing="none")  # one search's four beams need 16
        outs = await asyncio.wait_for(asyncio.gather(*(results(service, p, BEAMS) for p in prompts)), 60)
        for prompt, out in zip(prompts, outs):
            want = reference_beams(prompt, BEAMS.num_beams, BEAMS.max_tokens)[: BEAMS.n]
            assert [o["ids"] for o in out] == [tokens for tokens, _ in want]
        assert_idle(service)
        await service.stop()

    run(scenario())


def test_beams_ride_along_in_speculative_decodings_verify_calls(fake_model_dir, tmp_path):
    """With speculative decoding on, a decode batch that holds a search's beams and drafted rows
    becomes a verify call: each row is read by its own request's mode, so the beams are still
    chosen among one another and the drafted rows still give plain decoding's tokens."""
    from tests.fake_program import expected_greedy, write_fake_artifacts

    wide = write_fake_artifacts(tmp_path / "wide", (fake_model_dir / "tokenizer.json").read_text(),
                                decode_sizes=(1, 4, 16), pages=256)
    # The model itself as the draft: a draft every step, all of it right.
    drafting = SpeculativeConfig("draft_model", 3, Artifacts.in_directory(fake_model_dir), disable_by_batch_size=0)
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompts = [[4 + (i * 7 + s) % 300 for i in range(6 + s)] for s in range(2)]
    beam_prompt = [4 + (i * 13) % 300 for i in range(9)]

    async def scenario():
        service = await started(wide.config.parent, speculative=drafting)
        outs = await asyncio.gather(results(service, beam_prompt, BEAMS), *(results(service, p, greedy) for p in prompts))
        want = reference_beams(beam_prompt, BEAMS.num_beams, BEAMS.max_tokens)[: BEAMS.n]
        assert [o["ids"] for o in outs[0]] == [tokens for tokens, _ in want]
        assert [o[0]["ids"] for o in outs[1:]] == [expected_greedy(p, greedy.max_tokens) for p in prompts]
        assert service.stats().speculation.steps > 0
        assert_idle(service)
        await service.stop()

    run(scenario())
