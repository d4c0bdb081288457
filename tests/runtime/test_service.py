"""GenerateService on the compiled tiny model: batching, prefix cache, pages, aborts, faults."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest

from kiln.runtime import GenerateService, InvalidRequestError, SamplingParams, ServiceConfig
from kiln.runtime.contract import Artifacts
from kiln.runtime.errors import ModelLoadError

pytestmark = pytest.mark.e2e


def run(coroutine):
    return asyncio.run(coroutine)


async def started(artifacts_dir, **options) -> GenerateService:
    return await GenerateService(ServiceConfig(Artifacts.in_directory(artifacts_dir), **options)).start()


async def collect(service, prompt, params, **kwargs) -> list[dict]:
    """Per completion: text, token ids, finish reason."""
    outs = [{"text": "", "ids": [], "finish": None, "first_token_step": None} for _ in range(params.n)]
    async for event in service.generate(prompt, params, **kwargs):
        out = outs[event.index]
        out["text"] += event.text
        out["ids"] += event.token_ids
        if event.finish_reason:
            out["finish"] = event.finish_reason
            out["error"] = event.error
    return outs


def assert_no_leaks(service: GenerateService, expect_idle: bool = True):
    service.cache.check_integrity()
    stats = service.cache.stats()
    assert stats.free + stats.cached + stats.active == stats.total
    if expect_idle:
        assert stats.active == 0
        assert service.pool.refcounts[0] == 0


def prompts(count, seed=0, low=3, high=60):
    rng = np.random.default_rng(seed)
    return [rng.integers(4, 384, int(rng.integers(low, high))).tolist() for _ in range(count)]


GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


async def solo_outputs(artifacts, batch, **options):
    service = await started(artifacts, **options)
    outs = []
    for prompt in batch:
        outs.append((await collect(service, prompt, GREEDY))[0]["ids"])
    assert_no_leaks(service)
    await service.stop()
    return outs


def test_batched_equals_solo_and_trie_equals_plain(tiny_artifacts):
    batch = prompts(6, seed=1)

    async def scenario():
        solo = await solo_outputs(tiny_artifacts, batch, prefix_sharing="none")
        for sharing in ("trie", "none"):
            service = await started(tiny_artifacts, prefix_sharing=sharing)
            together = await asyncio.gather(*(collect(service, p, GREEDY) for p in batch))
            assert [t[0]["ids"] for t in together] == solo
            assert all(t[0]["finish"] == "length" for t in together)
            assert_no_leaks(service)
            await service.stop()

    run(scenario())


def test_batch_invariant_gives_a_request_the_same_tokens_and_logprobs_alone_and_in_a_busy_batch(tiny_artifacts):
    """The build without the CPU kernels decodes through IREE's matmuls, which tile a row's sums by
    the call's shape; batch_invariant calls every prefill and decode at batch one, so a request's
    greedy tokens and logprobs are the same bits alone and among others, prefilled partly from the
    prefix cache or not."""
    shared = prompts(1, seed=11, low=40, high=41)[0]
    batch = [shared + tail for tail in prompts(5, seed=12, low=2, high=30)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)

    async def outputs(service, together: bool) -> list[list]:
        async def one(prompt):
            events = [event async for event in service.generate(prompt, params)]
            return [(token, logprob) for event in events for token, logprob in zip(event.token_ids, event.logprobs)]
        if together:
            return await asyncio.gather(*(one(prompt) for prompt in batch))
        return [await one(prompt) for prompt in batch]

    async def scenario():
        alone_service = await started(tiny_artifacts, batch_invariant=True, prefix_sharing="none")
        alone = await outputs(alone_service, together=False)
        await alone_service.stop()
        service = await started(tiny_artifacts, batch_invariant=True)
        calls = []
        call = service.program.call
        service.program.call = lambda name, *args: calls.append(name) or call(name, *args)
        together = await outputs(service, together=True)
        assert together == alone
        assert calls and all(name.split("_ctx")[0].endswith("_bs1") for name in calls), sorted(set(calls))
        assert service.stats().prefix_hit_tokens > 0
        assert_no_leaks(service)
        await service.stop()

    run(scenario())


def test_cached_prefix_gives_the_same_tokens_and_skips_prefill(tiny_artifacts):
    prefix = prompts(1, seed=2, low=50, high=51)[0]
    first, second = prefix + [7, 8, 9], prefix + [10, 11]

    async def scenario():
        cold = await solo_outputs(tiny_artifacts, [second], prefix_sharing="none")
        service = await started(tiny_artifacts, prefix_sharing="trie")
        await collect(service, first, GREEDY)
        hits_before = service.stats().prefix_hit_tokens
        warm = (await collect(service, second, GREEDY))[0]["ids"]
        assert service.stats().prefix_hit_tokens - hits_before == 48  # three whole pages of 16
        assert warm == cold[0]
        assert_no_leaks(service)
        await service.stop()

    run(scenario())


def test_chunked_prefill_equals_whole_prefill(tiny_artifacts):
    batch = prompts(3, seed=3, low=70, high=120)

    async def scenario():
        whole = await solo_outputs(tiny_artifacts, batch, chunk_tokens=256)
        chunked = await solo_outputs(tiny_artifacts, batch, chunk_tokens=16)
        assert chunked == whole

    run(scenario())


def test_a_new_request_is_served_while_others_decode(tiny_artifacts):
    long_params = SamplingParams(max_tokens=150, temperature=0, ignore_eos=True)

    async def scenario():
        service = await started(tiny_artifacts)
        order = []

        async def tracked(name, prompt, params):
            async for event in service.generate(prompt, params):
                if event.token_ids and name not in order:
                    order.append(name)
                if event.finish_reason:
                    order.append(f"{name} done")

        long_ones = [asyncio.create_task(tracked(f"long{i}", p, long_params)) for i, p in enumerate(prompts(2, seed=4))]
        while "long0" not in order or "long1" not in order:
            await asyncio.sleep(0.001)
        await tracked("late", [5, 6, 7], SamplingParams(max_tokens=1, temperature=0))
        await asyncio.gather(*long_ones)
        assert order.index("late") < order.index("long0 done")
        assert order.index("late") < order.index("long1 done")
        await service.stop()

    run(scenario())


def test_more_requests_than_pages_all_complete(tiny_artifacts):
    # 11 usable pages of 16 tokens; each request needs up to 5 of them.
    batch = prompts(8, seed=5, low=30, high=50)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)

    async def scenario():
        solo_service = await started(tiny_artifacts)
        solo = [(await collect(solo_service, p, params))[0]["ids"] for p in batch]
        await solo_service.stop()
        for sharing in ("trie", "none"):
            service = await started(tiny_artifacts, page_count=12, prefix_sharing=sharing)
            together = await asyncio.gather(*(collect(service, p, params) for p in batch))
            assert [t[0]["ids"] for t in together] == solo
            assert all(t[0]["finish"] == "length" for t in together)
            assert service.stats().preemptions > 0 or sharing == "trie"
            assert_no_leaks(service)
            await service.stop()

    run(scenario())


def test_abort_mid_decode_frees_pages(tiny_artifacts):
    async def scenario():
        service = await started(tiny_artifacts)
        stream = service.generate(prompts(1, seed=6)[0], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
        seen = 0
        async for event in stream:
            seen += len(event.token_ids)
            if seen == 5:
                break
        await stream.aclose()  # leaving early aborts the request
        for _ in range(100):
            if service.cache.stats().active == 0:
                break
            await asyncio.sleep(0.01)
        assert_no_leaks(service)
        await service.stop()

    run(scenario())


def test_200_random_requests_with_random_aborts_leave_every_page_free(tiny_artifacts):
    rng = random.Random(7)

    async def one(service, index):
        params = SamplingParams(max_tokens=rng.randint(1, 40), temperature=rng.choice([0, 0.8]), seed=index,
                                n=rng.choice([1, 1, 1, 2]), ignore_eos=rng.random() < 0.5)
        prompt = prompts(1, seed=100 + index, low=1, high=90)[0]
        abort_after = rng.choice([None, None, 0, 1, 3, 10])
        await asyncio.sleep(rng.random() * 0.05)
        events = 0
        stream = service.generate(prompt, params, request_id=f"r{index}")
        async for _ in stream:
            events += 1
            if abort_after is not None and events > abort_after:
                break
        await stream.aclose()

    async def scenario():
        service = await started(tiny_artifacts, page_count=24)
        await asyncio.gather(*(one(service, i) for i in range(200)))
        for _ in range(200):
            if service.cache.stats().active == 0 and not service.in_flight:
                break
            await asyncio.sleep(0.01)
        assert_no_leaks(service)
        stats = service.cache.stats()
        assert stats.free + stats.cached == stats.total
        service.cache.evict_all_unreferenced()
        assert service.cache.stats().free == stats.total
        await service.stop()

    run(scenario())


def test_sampling_rules(tiny_artifacts):
    prompt = prompts(1, seed=8)[0]

    async def scenario():
        service = await started(tiny_artifacts)
        seeded = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
        assert (await collect(service, prompt, seeded)) == (await collect(service, prompt, seeded))
        greedy = (await collect(service, prompt, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)))[0]
        top1 = (await collect(service, prompt, SamplingParams(max_tokens=20, temperature=1.5, top_k=1, seed=5,
                                                              ignore_eos=True)))[0]
        assert top1["ids"] == greedy["ids"]
        many = await collect(service, prompt, SamplingParams(max_tokens=20, temperature=1.0, n=3, seed=9, ignore_eos=True))
        assert len(many) == 3 and all(len(c["ids"]) == 20 for c in many)
        assert len({tuple(c["ids"]) for c in many}) > 1
        # A stop string from the middle of the greedy text cuts the output right before it.
        text = greedy["text"]
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        if stop.strip():
            cut = (await collect(service, prompt, SamplingParams(max_tokens=20, temperature=0, stop=[stop],
                                                                 ignore_eos=True)))[0]
            assert cut["text"] == text[: text.index(stop)]
            assert cut["finish"] == "stop"
        assert_no_leaks(service)
        await service.stop()

    run(scenario())


@pytest.mark.parametrize(
    "prompt,params,message",
    [
        ([], SamplingParams(), "empty"),
        ([5] * 250, SamplingParams(max_tokens=10), "maximum context length"),
        ([5, 384], SamplingParams(), "outside the vocabulary"),
        ([5, -1], SamplingParams(), "outside the vocabulary"),
        ([5], SamplingParams(temperature=-1), "temperature"),
        ([5], SamplingParams(top_p=0), "top_p"),
        ([5], SamplingParams(n=0), "n"),
        ([5], SamplingParams(max_tokens=0), "max_tokens"),
    ],
    ids=["empty", "too-long", "id-too-big", "negative-id", "temperature", "top-p", "n", "max-tokens"],
)
def test_bad_requests_are_refused_and_nothing_else_is_affected(tiny_artifacts, prompt, params, message):
    async def scenario():
        service = await started(tiny_artifacts)
        with pytest.raises(InvalidRequestError, match=message):
            async for _ in service.generate(prompt, params):
                pass
        ok = await collect(service, [5, 6, 7], GREEDY)
        assert len(ok[0]["ids"]) == 12
        assert_no_leaks(service)
        await service.stop()

    try:
        run(scenario())
    except ValueError as error:  # SamplingParams may refuse the value as soon as it is built
        assert message in str(error)


def test_a_failed_invocation_fails_its_batch_and_the_service_goes_on(tiny_artifacts):
    async def scenario():
        service = await started(tiny_artifacts)
        executor = service.batcher.executor
        real = executor._invoke
        poisoned = {"armed": True}

        def flaky(invocation):
            if poisoned["armed"] and invocation.function.startswith("decode"):
                poisoned["armed"] = False
                raise RuntimeError("device fault (injected)")
            return real(invocation)

        executor._invoke = flaky
        failed = await collect(service, [5, 6, 7], GREEDY)
        assert failed[0]["finish"] == "error" and "device fault" in failed[0]["error"]
        ok = await collect(service, [5, 6, 7], GREEDY)
        assert ok[0]["finish"] == "length" and len(ok[0]["ids"]) == 12
        assert service.stats().steps["failed"] == 1
        assert_no_leaks(service)
        await service.stop()

    run(scenario())


@pytest.fixture(scope="module")
def shortfin_style_artifacts(tiny_hf_dir, tmp_path_factory):
    """The tiny model exported as sharktank does: prefill without start positions, no Kiln sidecar."""
    from tests.conftest import TINY_EXPORT_ARGS, run_kiln

    out = tmp_path_factory.mktemp("tiny-shortfin-style")
    run_kiln("export-model", "--model", str(tiny_hf_dir), "--output-dir", str(out), "--no-prefill-position",
             *TINY_EXPORT_ARGS)
    run_kiln("compile-vmfb", str(out / "model.mlir"), "--target", "cpu", "-o", str(out / "model_cpu.vmfb"))
    (out / "model.kiln.json").unlink()
    return out


def test_serves_an_export_without_prefill_positions_or_sidecar(tiny_artifacts, shortfin_style_artifacts):
    batch = prompts(4, seed=9, low=10, high=70)

    async def scenario():
        want = await solo_outputs(tiny_artifacts, batch)
        service = await started(shortfin_style_artifacts)
        assert not service.program.params.has_prefill_position
        assert type(service.cache).__name__ == "PlainPagedAttentionCache"
        got = await asyncio.gather(*(collect(service, p, GREEDY) for p in batch))
        assert [g[0]["ids"] for g in got] == want
        assert_no_leaks(service)
        await service.stop()

    run(scenario())


def test_cache_sized_from_a_memory_budget(tiny_artifacts):
    async def scenario():
        page_bytes = 2 * 2 * 2 * 16 * 16 * 4  # layers * (k, v) * kv_heads * stride * head_dim * f32
        service = await started(tiny_artifacts, memory_budget_bytes=page_bytes * 40)
        assert service.pool.page_count == 40
        assert len((await collect(service, [5, 6, 7], GREEDY))[0]["ids"]) == 12
        await service.stop()

    run(scenario())


def test_cache_sized_from_a_share_of_memory_and_cut_to_fit_by_default(tiny_artifacts, monkeypatch, caplog):
    from kiln.runtime import service as service_module
    from kiln.runtime.kv_cache_size import DeviceMemory

    page_bytes = 2 * 2 * 2 * 16 * 16 * 4
    # 1.5 MiB in use of 2 MiB: below 95% of it, 51 pages of 8 KiB; below 50%, none.
    monkeypatch.setattr(service_module, "device_memory", lambda uri: DeviceMemory(2**21, 2**19))

    async def scenario():
        service = await started(tiny_artifacts, memory_fraction=0.95)
        assert service.pool.page_count == int(0.95 * 2**21 - 3 * 2**19) // page_bytes == 51
        assert len((await collect(service, [5, 6, 7], GREEDY))[0]["ids"]) == 12
        await service.stop()
        with caplog.at_level("INFO", logger="kiln.service"):
            service = await started(tiny_artifacts)  # below 90%: 38 pages, where the export has 64
        assert service.pool.page_count == int(0.9 * 2**21 - 3 * 2**19) // page_bytes == 38
        assert "cut from the export's" in caplog.text
        await service.stop()
        with pytest.raises(ModelLoadError, match="below 50% of the device"):
            await started(tiny_artifacts, memory_fraction=0.5)

    run(scenario())


def test_lifecycle_states(tiny_artifacts):
    from kiln.runtime import NotReadyError, ServiceState

    async def scenario():
        service = GenerateService(ServiceConfig(Artifacts.in_directory(tiny_artifacts)))
        assert service.state is ServiceState.LOADING
        await service.start()
        assert service.state is ServiceState.READY
        long_running = asyncio.create_task(collect(service, [5, 6], SamplingParams(max_tokens=100, temperature=0,
                                                                                       ignore_eos=True)))
        await asyncio.sleep(0.01)
        stopping = asyncio.create_task(service.stop(grace_seconds=30))
        await asyncio.sleep(0)
        assert service.state is ServiceState.DRAINING
        with pytest.raises(NotReadyError, match="draining"):
            service.submit([5], GREEDY)
        finished = await long_running
        await stopping
        assert finished[0]["finish"] == "length" and len(finished[0]["ids"]) == 100  # drained, not cut
        assert service.state is ServiceState.STOPPED

    run(scenario())


def _with_generation_defaults(tiny_artifacts, directory, defaults: dict):
    """The tiny build with `defaults` as its model's generation defaults (as an export from a
    generation_config.json writes them into model.kiln.json)."""
    import json

    directory.mkdir()
    for file in tiny_artifacts.iterdir():
        if file.name != "model.kiln.json":
            (directory / file.name).symlink_to(file)
    kiln = json.loads((tiny_artifacts / "model.kiln.json").read_text())
    (directory / "model.kiln.json").write_text(json.dumps({**kiln, "generation_defaults": defaults}))
    return directory


def test_a_request_without_sampling_fields_samples_with_the_models_defaults(tiny_artifacts, tmp_path):
    from kiln.runtime import LLM
    from kiln.runtime.errors import ModelLoadError

    greedy_model = _with_generation_defaults(tiny_artifacts, tmp_path / "greedy", {"temperature": 0.0})
    prompt = prompts(1, seed=3)[0]
    with LLM(Artifacts.in_directory(greedy_model)) as llm:
        assert llm.service.generation_defaults == {"temperature": 0.0}
        unset = llm.generate([prompt], SamplingParams.from_kwargs(model_defaults=llm.service.generation_defaults,
                                                                  max_tokens=12, ignore_eos=True, seed=1))
        assert unset[0].completions[0].token_ids == llm.generate([prompt], GREEDY)[0].completions[0].token_ids
        assert llm.default_params().temperature == 0.0
    with LLM(Artifacts.in_directory(greedy_model), sampling_defaults="openai") as llm:
        assert llm.service.generation_defaults == {} and llm.default_params().temperature == 1.0
    bad = _with_generation_defaults(tiny_artifacts, tmp_path / "bad", {"top_p": 2.0})
    with pytest.raises(ModelLoadError, match=r"model\.kiln\.json's generation_defaults: top_p must be in \(0, 1\]"):
        LLM(Artifacts.in_directory(bad))
