"""Diffusion generation through GenerateService on compiled tiny LLaDA and Dream models,
against the torch reference (tests/diffusion_reference.py): same tokens, same forward passes."""

from __future__ import annotations

import asyncio

import pytest

from kiln.export.export_model import build_model
from kiln.export.options import ExportOptions
from kiln.models.loader import load_checkpoint
from kiln.runtime import GenerateService, InvalidRequestError, SamplingParams, ServiceConfig
from kiln.runtime.contract import Artifacts
from kiln.runtime.diffusion.params import DiffusionParams
from tests.diffusion_reference import generate

pytestmark = pytest.mark.e2e
PROMPTS = [[5, 9, 200, 31, 7, 100, 42], [17, 250, 33], list(range(40, 61))]


def run(coroutine):
    return asyncio.run(coroutine)


@pytest.fixture(scope="module", params=["llada", "dream"])
def model(request):
    """(artifacts directory, torch model, its config) for each format."""
    checkpoint = load_checkpoint(request.getfixturevalue(f"tiny_{request.param}_hf"))
    torch_model = build_model(checkpoint, ExportOptions().validate(256))
    return request.getfixturevalue(f"tiny_{request.param}_artifacts"), torch_model, checkpoint.config


async def started(artifacts, **options) -> GenerateService:
    return await GenerateService(ServiceConfig(Artifacts.in_directory(artifacts), **options)).start()


async def kiln_generate(service, prompt, params):
    """(generated token ids, forward passes, finish reason)."""
    request = service.submit(prompt, params)
    tokens, finish = [], None
    async for event in service.stream(request):
        tokens += event.token_ids
        finish = event.finish_reason or finish
    return tokens, request.forward_passes, finish


def reference(model, config, prompt, max_tokens, diffusion: DiffusionParams, stop_ids=()):
    plan = diffusion.plan(max_tokens)
    return generate(model, prompt, gen_length=plan.canvas_length, block_length=plan.block_length,
                    steps=plan.steps_per_block * plan.blocks, mask_id=config.mask_token_id, shift=config.logits_shift,
                    remasking=diffusion.remasking, confidence=diffusion.confidence, threshold=diffusion.threshold,
                    cache=diffusion.cache, cfg_scale=diffusion.cfg_scale, stop_ids=stop_ids)


def assert_idle(service):
    service.cache.check_integrity()
    assert service.cache.stats().active == 0


CASES = [
    DiffusionParams(steps=16, block_length=8),  # LLaDA's fixed schedule, semi-autoregressive blocks
    DiffusionParams(steps=16, block_length=8, threshold=0.3),  # Fast-dLLM parallel decoding
    DiffusionParams(steps=8, block_length=16, cache="prefix", threshold=0.3),
    DiffusionParams(steps=16, block_length=8, cache="dual", threshold=0.3),
    DiffusionParams(steps=32, block_length=32, cache="dual", confidence="margin"),
    DiffusionParams(steps=16, block_length=8, cache="prefix", confidence="entropy"),
    DiffusionParams(steps=16, block_length=8, confidence="margin", threshold=0.2),
    DiffusionParams(steps=16, block_length=16, cfg_scale=1.5),  # LLaDA's classifier-free guidance
]


@pytest.mark.parametrize("diffusion", CASES, ids=lambda d: f"{d.cache}-{d.confidence}-t{d.threshold}-cfg{d.cfg_scale}")
def test_one_request_matches_the_reference(model, diffusion):
    artifacts, torch_model, config = model

    async def main():
        service = await started(artifacts)
        params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, diffusion=diffusion)
        got = await kiln_generate(service, PROMPTS[0], params)
        assert_idle(service)
        await service.stop()
        return got

    tokens, passes, finish = run(main())
    want = reference(torch_model, config, PROMPTS[0], 32, diffusion)
    assert (tokens, passes) == (want.tokens, want.forward_passes)
    assert finish == "length" and len(tokens) == 32
    if diffusion.threshold is not None and diffusion.confidence == "top1":
        assert max(want.committed_per_pass) > 1  # the threshold commits several tokens in some passes


def test_requests_batched_together_match_each_alone(model):
    """Mixed prompt lengths and modes submitted at once share denoise calls and change nothing."""
    artifacts, torch_model, config = model
    modes = [CASES[1], CASES[3], CASES[2]]

    async def main():
        service = await started(artifacts)
        params = [SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, diffusion=d) for d in modes]
        results = await asyncio.gather(*(kiln_generate(service, p, q) for p, q in zip(PROMPTS, params)))
        # And the same mode for all three: they go in one batch of 4 (whole-sequence rows padded).
        same = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, diffusion=CASES[1])
        batched = await asyncio.gather(*(kiln_generate(service, p, same) for p in PROMPTS))
        denoise_steps = service.stats().steps["denoise"]
        assert_idle(service)
        await service.stop()
        return results, batched, denoise_steps

    results, batched, steps = run(main())
    for prompt, diffusion, (tokens, passes, _) in zip(PROMPTS, modes, results):
        want = reference(torch_model, config, prompt, 32, diffusion)
        assert (tokens, passes) == (want.tokens, want.forward_passes)
    alone = [reference(torch_model, config, p, 32, CASES[1]) for p in PROMPTS]
    for (tokens, passes, _), want in zip(batched, alone):
        assert (tokens, passes) == (want.tokens, want.forward_passes)
    total_passes = sum(r[1] for r in results) + sum(r[1] for r in batched)
    assert steps < total_passes  # some calls carried several requests


def test_a_stop_token_ends_generation_early(model):
    """Without ignore_eos the text ends at the first stop token committed without a gap, and
    the passes stop there too (as the reference's early exit)."""
    artifacts, torch_model, config = model
    diffusion = DiffusionParams(steps=32, block_length=8, threshold=0.3)
    probe = reference(torch_model, config, PROMPTS[2], 32, diffusion)
    stop = probe.tokens[5]  # a token the model commits: make it a stop token

    async def main():
        service = await started(artifacts)
        params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, stop_token_ids=[stop],
                                diffusion=diffusion)
        got = await kiln_generate(service, PROMPTS[2], params)
        assert_idle(service)
        await service.stop()
        return got

    tokens, passes, finish = run(main())
    want = reference(torch_model, config, PROMPTS[2], 32, diffusion, stop_ids={stop})
    assert (tokens, passes) == (want.tokens, want.forward_passes)
    assert finish == "stop" and tokens[-1] == stop and len(tokens) <= 6
    assert passes < probe.forward_passes


def test_sampling_and_random_remasking_fill_the_canvas_and_repeat_with_a_seed(model):
    artifacts, _, config = model

    async def main():
        service = await started(artifacts)
        outs = []
        for seed in (7, 7, 8):
            params = SamplingParams(max_tokens=24, temperature=0.8, seed=seed, ignore_eos=True,
                                    diffusion=DiffusionParams(block_length=8, remasking="random", cache="dual"))
            outs.append(await kiln_generate(service, PROMPTS[1], params))
        assert_idle(service)
        await service.stop()
        return outs

    (first, passes, _), (again, _, _), (other, _, _) = run(main())
    assert len(first) == 24 and config.mask_token_id not in first and passes == 24
    assert first == again and first != other


def test_aborts_return_every_page_and_bad_options_are_refused(model):
    artifacts, _, _ = model

    async def main():
        service = await started(artifacts, max_running=2)
        params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True,
                                diffusion=DiffusionParams(steps=64, block_length=16))
        requests = [service.submit(p, params) for p in PROMPTS]
        await asyncio.sleep(0.05)
        for request in requests:
            service.abort(request.request_id)
        for request in requests:
            async for _ in service.stream(request):
                pass
        assert_idle(service)
        refused = []
        for bad in (dict(diffusion=DiffusionParams(steps=7, block_length=8)),  # 4 blocks do not divide 7 steps
                    dict(diffusion=DiffusionParams(cache="dual", cfg_scale=1.0)),
                    dict(diffusion=DiffusionParams(remasking="sometimes")),
                    dict(presence_penalty=0.5), dict(logprobs=2), dict(max_tokens=400)):
            fields = {"max_tokens": 32, **bad}
            with pytest.raises(InvalidRequestError) as error:
                service.submit(PROMPTS[0], SamplingParams(**fields))
            refused.append(error.value.param)
        await service.stop()
        return refused

    assert run(main()) == ["steps", "cfg_scale", "remasking", "presence_penalty", "logprobs", "max_tokens"]
