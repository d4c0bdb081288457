"""The whole step loop (scheduler, executor, sampler, output processor) on a fake program:
batching, chunks, the prefix cache, preemption, stop rules and aborts, with no compiled model."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from kiln.runtime import GenerateService, SamplingParams, ServiceConfig
from kiln.runtime.contract import Artifacts
from kiln.runtime.errors import InvalidRequestError, QueueFullError
from kiln.runtime.request import SequenceState
from tests.fake_program import EOS, FakeProgram, expected_greedy, next_token

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def run(coroutine):
    return asyncio.run(coroutine)


async def started(directory, **options) -> GenerateService:
    config = ServiceConfig(Artifacts.in_directory(directory), **options)
    return await GenerateService(config, program_factory=FakeProgram).start()


async def collect(service, prompt, params):
    outs = [{"text": "", "ids": [], "finish": None, "stop": None} for _ in range(params.n)]
    async for event in service.generate(prompt, params):
        out = outs[event.index]
        out["text"] += event.text
        out["ids"] += event.token_ids
        if event.finish_reason:
            out["finish"], out["stop"] = event.finish_reason, event.stop_reason
    return outs


def assert_idle(service):
    service.cache.check_integrity()
    stats = service.cache.stats()
    assert stats.active == 0 and stats.free + stats.cached == stats.total
    assert service.in_flight == 0


async def settle(service):
    """Wait (a second at most) for aborted requests to leave, then check nothing is held."""
    for _ in range(100):
        if service.in_flight == 0:
            break
        await asyncio.sleep(0.01)
    assert_idle(service)


def prompt(length, seed):
    return [4 + (seed * 31 + i * 7) % 300 for i in range(length)]


def test_batched_greedy_equals_the_rule_for_mixed_lengths_and_chunks(fake_model_dir):
    prompts = [prompt(n, i) for i, n in enumerate((3, 9, 40, 17, 64, 5, 33))]

    async def scenario():
        service = await started(fake_model_dir, chunk_tokens=8, prefill_token_budget=16)
        outs = await asyncio.gather(*(collect(service, p, GREEDY) for p in prompts))
        assert [o[0]["ids"] for o in outs] == [expected_greedy(p, 12) for p in prompts]
        assert all(o[0]["finish"] == "length" for o in outs)
        calls = service.program.calls
        assert any(c.startswith("prefill_last") for c in calls) and any(c.startswith("decode") for c in calls)
        assert_idle(service)
        await service.stop()

    run(scenario())


def test_a_shared_prefix_is_served_from_the_cache_and_gives_the_same_tokens(fake_model_dir):
    system = prompt(24, 99)

    async def scenario():
        service = await started(fake_model_dir)
        first = await collect(service, system + [7, 8], GREEDY)
        second = await collect(service, system + [9], GREEDY)
        assert first[0]["ids"] == expected_greedy(system + [7, 8], 12)
        assert second[0]["ids"] == expected_greedy(system + [9], 12)
        assert service.cache.stats().hit_tokens >= 24
        assert_idle(service)
        await service.stop()

    run(scenario())


def test_preemption_under_a_small_pool_loses_nothing(fake_model_dir):
    prompts = [prompt(30, i) for i in range(6)]
    params = dataclasses.replace(GREEDY, max_tokens=30)

    async def scenario():
        service = await started(fake_model_dir, page_count=40)  # ~2 sequences' worth of 4-token pages
        outs = await asyncio.gather(*(collect(service, p, params) for p in prompts))
        assert [o[0]["ids"] for o in outs] == [expected_greedy(p, 30) for p in prompts]
        assert service.stats().preemptions > 0
        assert_idle(service)
        await service.stop()

    run(scenario())


def test_eos_stop_tokens_stop_strings_and_n(fake_model_dir):
    p = prompt(6, 3)
    want = expected_greedy(p, 12)

    async def scenario():
        service = await started(fake_model_dir)
        # A stop token: the token ends the output and is reported, not shown.
        [out] = await collect(service, p, dataclasses.replace(GREEDY, stop_token_ids=[want[3]]))
        assert out["ids"] == want[:4] and out["finish"] == "stop" and out["stop"] == want[3]
        # include_stop_str_in_output is about stop strings: a stop token stays out of the text.
        [kept] = await collect(service, p, dataclasses.replace(GREEDY, stop_token_ids=[want[3]],
                                                               include_stop_str_in_output=True))
        assert kept == out
        # A stop string cut out of the text: found in the plain output, then asked for.
        [plain] = await collect(service, p, GREEDY)
        needle = plain["text"][len(plain["text"]) // 2:][:2]
        if needle:
            [cut] = await collect(service, p, dataclasses.replace(GREEDY, stop=[needle]))
            assert cut["finish"] == "stop" and cut["stop"] == needle
            assert cut["text"] == plain["text"][: plain["text"].find(needle)]
            # Asked for, the stop string stays at the end of the text.
            [kept] = await collect(service, p, dataclasses.replace(GREEDY, stop=[needle],
                                                                   include_stop_str_in_output=True))
            assert kept["finish"] == "stop" and kept["stop"] == needle
            assert kept["text"] == plain["text"][: plain["text"].find(needle) + len(needle)]
            # min_tokens holds back stop strings as it holds back end tokens: none ends the text early.
            early = len(plain["ids"]) - 1
            [held] = await collect(service, p, dataclasses.replace(GREEDY, stop=[needle], min_tokens=early))
            assert len(held["ids"]) >= early and held["text"].startswith(plain["text"][: plain["text"].find(needle)])
            assert len(held["text"]) > plain["text"].find(needle)
        # n > 1 greedy: the same tokens on every sequence, the prompt computed once.
        outs = await collect(service, p, dataclasses.replace(GREEDY, n=3))
        assert [o["ids"] for o in outs] == [want] * 3
        assert_idle(service)
        await service.stop()

    run(scenario())


def test_eos_finishes_unless_ignored(fake_model_dir, monkeypatch):
    import tests.fake_program as fake

    p = prompt(5, 4)
    real = fake.next_token
    # The model says EOS after three tokens of output.
    monkeypatch.setattr(fake, "next_token", lambda prefix: EOS if len(prefix) == len(p) + 3 else real(prefix))

    async def scenario():
        service = await started(fake_model_dir)
        [out] = await collect(service, p, SamplingParams(max_tokens=8, temperature=0))
        assert out["finish"] == "stop" and out["stop"] == EOS and len(out["ids"]) == 4 and out["ids"][-1] == EOS
        [out] = await collect(service, p, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        assert out["finish"] == "length" and len(out["ids"]) == 8
        assert_idle(service)
        await service.stop()

    run(scenario())


def test_abort_mid_stream_returns_every_page(fake_model_dir):
    async def scenario():
        service = await started(fake_model_dir)
        request = service.submit(prompt(20, 5), dataclasses.replace(GREEDY, max_tokens=200, n=2))
        seen = 0
        async for event in service.stream(request):
            seen += len(event.token_ids)
            if seen >= 3:
                break  # leaving the stream aborts the request
        await settle(service)
        assert all(s.state is SequenceState.FINISHED for s in request.sequences)
        await service.stop()

    run(scenario())


async def two_requests_through_a_failing_step(service, monkeypatch, also=lambda scheduler: None) -> list:
    """Two 50-token requests whose fourth scheduling raises (after `also(scheduler)` has broken
    more), each one's events, within a timeout."""
    scheduler = service.batcher.scheduler
    schedule, calls = scheduler.schedule, []

    def faulty():
        calls.append(1)
        if len(calls) == 4:
            also(scheduler)
            raise RuntimeError("scheduling went wrong")
        return schedule()

    monkeypatch.setattr(scheduler, "schedule", faulty)
    params = dataclasses.replace(GREEDY, max_tokens=50)
    return await asyncio.wait_for(asyncio.gather(collect(service, prompt(20, 1), params),
                                                 collect(service, prompt(30, 2), params)), 30)


def test_a_fault_outside_a_model_call_ends_the_requests_in_flight_and_serving_goes_on(fake_model_dir, monkeypatch):
    """The scheduler raising mid-stream (a bug, a failed page copy): the requests in flight end with
    an error rather than waiting forever, every page comes back, and the next request is served."""
    async def scenario():
        service = await started(fake_model_dir)
        first, second = await two_requests_through_a_failing_step(service, monkeypatch)
        assert first[0]["finish"] == second[0]["finish"] == "error"
        await settle(service)
        [after] = await asyncio.wait_for(collect(service, prompt(20, 1), dataclasses.replace(GREEDY, max_tokens=50)), 30)
        assert after["finish"] == "length" and len(after["ids"]) == 50
        await service.stop()

    run(scenario())


def test_requests_in_flight_end_even_when_ending_them_fails_too(fake_model_dir, monkeypatch):
    """The scheduler raising, and then again as the requests are ended (its state is what went
    wrong): their last events still go out, with the error, rather than leaving them waiting."""
    def failing_finish(seq, reason):
        raise RuntimeError("finishing went wrong")

    async def scenario():
        service = await started(fake_model_dir)
        first, second = await two_requests_through_a_failing_step(
            service, monkeypatch, also=lambda scheduler: monkeypatch.setattr(scheduler, "finish", failing_finish))
        assert first[0]["finish"] == second[0]["finish"] == "error"
        assert not service.batcher.requests
        await service.stop()

    run(scenario())


def test_bad_requests_and_a_full_queue_are_typed_errors(fake_model_dir):
    async def scenario():
        service = await started(fake_model_dir, max_queue=1)
        with pytest.raises(InvalidRequestError) as bad:
            service.submit([5, 400], GREEDY)
        assert bad.value.param == "prompt" and bad.value.status == 400
        with pytest.raises(InvalidRequestError) as bad:
            service.submit([5], SamplingParams(top_p=0))
        assert bad.value.param == "top_p"
        # The batcher task has not run yet: the first request still waits, the second is refused.
        first = service.submit([5, 6], GREEDY)
        with pytest.raises(QueueFullError) as full:
            service.submit([5, 6], GREEDY)
        assert full.value.status == 503 and full.value.code == "queue_full"
        async for _ in service.stream(first):
            pass
        assert_idle(service)
        await service.stop()

    run(scenario())


def test_the_fake_program_depends_on_every_token_of_the_prefix():
    assert next_token([5, 6, 7]) != next_token([5, 6, 8]) != next_token([6, 6, 8])
    assert expected_greedy([5], 3)[0] == next_token([5])


@pytest.mark.parametrize("chunk_tokens", [256, 16])
def test_requests_arriving_together_with_one_prompt_compute_it_once(fake_model_dir, chunk_tokens):
    shared = prompt(64, 9)

    async def scenario():
        service = await started(fake_model_dir, chunk_tokens=chunk_tokens)
        prompts = [shared, shared, shared + [7, 8, 9], shared[:40] + [5] * 30, prompt(20, 3)]
        outs = await asyncio.gather(*(collect(service, p, GREEDY) for p in prompts))
        assert [o[0]["ids"] for o in outs] == [expected_greedy(p, GREEDY.max_tokens) for p in prompts]
        # The first computes the 64 shared tokens; the others wait for its pages rather than
        # computing them too: 60 (the same prompt: the cache leaves its last page to compute), 64, 40.
        assert service.cache.stats().hit_tokens == 60 + 64 + 40
        assert_idle(service)
        await service.stop()

    run(scenario())


def test_a_batch_invariant_service_calls_every_prefill_and_decode_one_row_at_a_time(fake_model_dir):
    prompts = [prompt(n, i) for i, n in enumerate((3, 9, 40, 17))]

    async def scenario():
        service = await started(fake_model_dir, chunk_tokens=8, batch_invariant=True)
        outs = await asyncio.gather(*(collect(service, p, GREEDY) for p in prompts))
        assert [o[0]["ids"] for o in outs] == [expected_greedy(p, 12) for p in prompts]
        calls = service.program.calls
        assert calls and all(c.endswith("_bs1") for c in calls), sorted(set(calls))
        assert len([c for c in calls if c.startswith("decode")]) >= 4 * 11  # each row of each step its own call
        assert_idle(service)
        await service.stop()

    run(scenario())


def test_batch_invariance_needs_batch_one_functions_and_no_speculation(fake_model_dir, tmp_path, tiny_checkpoint):
    from kiln.runtime.errors import ModelLoadError
    from kiln.runtime.service_config import SpeculativeConfig
    from tests.fake_program import write_fake_artifacts

    with pytest.raises(ValueError, match="speculative decoding .* batch_invariant"):
        ServiceConfig(Artifacts.in_directory(fake_model_dir), batch_invariant=True,
                      speculative=SpeculativeConfig("ngram"))
    write_fake_artifacts(tmp_path, tiny_checkpoint.tokenizer_json, prefill_sizes=(4,), decode_sizes=(2, 4))
    with pytest.raises(ModelLoadError, match="batch 1.*--bs-prefill and --bs-decode"):
        run(started(tmp_path, batch_invariant=True))
