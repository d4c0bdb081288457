"""APD on the compiled tiny LLaDA with a tiny autoregressive verifier of the same tokenizer: the
mixture weight's two ends are the two models' greedy outputs, whatever the windows."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from kiln.export.export_model import build_model
from kiln.export.options import ExportOptions
from kiln.models.loader import load_checkpoint
from kiln.runtime import GenerateService, InvalidRequestError, SamplingParams, ServiceConfig
from kiln.runtime.contract import Artifacts
from kiln.runtime.diffusion.params import DiffusionParams
from kiln.runtime.errors import ModelLoadError
from tests.diffusion_model import MASK_ID

pytestmark = pytest.mark.e2e
PROMPT = [5, 9, 200, 31, 7, 100, 42]
LENGTH = 24


@pytest.fixture(scope="module")
def models(tiny_llada_hf, tiny_verifier_hf):
    def torch_model(path):
        return build_model(load_checkpoint(path), ExportOptions().validate(256))

    return torch_model(tiny_llada_hf), torch_model(tiny_verifier_hf)


@torch.no_grad()
def verifier_greedy(model, prompt, length) -> list[int]:
    tokens = list(prompt)
    for _ in range(length):
        logits = model.forward_reference(torch.tensor([tokens]))[0, -1]
        logits[MASK_ID] = -torch.inf  # a mask is never committed
        tokens.append(int(logits.argmax()))
    return tokens[len(prompt):]


@torch.no_grad()
def diffusion_left_to_right(model, prompt, length, lookahead) -> tuple[list[int], int]:
    """Greedy: each pass sees the sequence up to `lookahead` open positions and commits them all."""
    tokens = list(prompt) + [MASK_ID] * length
    current, passes = len(prompt), 0
    while current < len(tokens):
        right = min(current + lookahead, len(tokens))
        logits = model.forward_reference(torch.tensor([tokens[:right]]))[0, current:right]
        logits[:, MASK_ID] = -torch.inf
        tokens[current:right] = logits.argmax(-1).tolist()
        current, passes = right, passes + 1
    return tokens[len(prompt):], passes


async def run_apd(llada, verifier, prompt, *options: DiffusionParams):
    config = ServiceConfig(Artifacts.in_directory(llada), apd_verifier=Artifacts.in_directory(verifier))
    service = await GenerateService(config).start()
    results = []
    for diffusion in options:
        request = service.submit(prompt, SamplingParams(max_tokens=LENGTH, temperature=0, ignore_eos=True,
                                                        diffusion=diffusion))
        tokens = []
        async for event in service.stream(request):
            tokens += event.token_ids
        results.append((tokens, request.forward_passes))
    for cache in (service.cache, service.verifier_cache):
        cache.check_integrity()
        assert cache.stats().active == 0
    steps = service.stats().steps
    await service.stop()
    return results, steps


def test_the_mixture_weight_spans_the_two_models(tiny_llada_artifacts, tiny_verifier_artifacts, models):
    llada, verifier = models
    options = [
        DiffusionParams(apd_mixture_weight=1.0, apd_max_lookahead=6),
        DiffusionParams(apd_mixture_weight=0.0, apd_max_lookahead=6),
        DiffusionParams(apd_mixture_weight=0.0, apd_max_lookahead=5, apd_kv_window=3),
        DiffusionParams(apd_mixture_weight=0.5, apd_max_lookahead=8, apd_kv_window=2),
    ]
    results, steps = asyncio.run(run_apd(tiny_llada_artifacts, tiny_verifier_artifacts, PROMPT, *options))
    (r1, passes1), (r0, _), (r0_window, _), (mixed, mixed_passes) = results
    want_diffusion, want_passes = diffusion_left_to_right(llada, PROMPT, LENGTH, 6)
    assert r1 == want_diffusion and passes1 == want_passes == 4  # R = 1: every draft token is accepted
    assert r0 == r0_window == verifier_greedy(verifier, PROMPT, LENGTH)  # R = 0: exactly the verifier's
    assert len(mixed) == LENGTH and MASK_ID not in mixed and mixed_passes <= LENGTH
    assert steps["verify"] >= steps["denoise"] - 1


def test_apd_options_are_checked(tiny_llada_artifacts, tiny_verifier_artifacts, tiny_artifacts):
    async def main():
        service = await GenerateService(ServiceConfig(Artifacts.in_directory(tiny_llada_artifacts))).start()
        refused = []
        for bad in (DiffusionParams(apd_mixture_weight=0.5),  # no verifier on this service
                    DiffusionParams(apd_mixture_weight=1.5), DiffusionParams(apd_kv_window=4),
                    DiffusionParams(apd_mixture_weight=0.5, apd_max_lookahead=0),
                    DiffusionParams(apd_mixture_weight=0.5, cache="dual")):
            with pytest.raises(InvalidRequestError) as error:
                service.submit(PROMPT, SamplingParams(max_tokens=8, diffusion=bad))
            refused.append(error.value.param)
        await service.stop()
        # A verifier whose tokenizer differs (the tiny Llama's own) is refused at load.
        config = ServiceConfig(Artifacts.in_directory(tiny_llada_artifacts),
                               apd_verifier=Artifacts.in_directory(tiny_artifacts))
        with pytest.raises(ModelLoadError, match="tokenizer"):
            await GenerateService(config).start()
        return refused

    assert asyncio.run(main()) == ["apd_mixture_weight", "apd_mixture_weight", "apd_mixture_weight",
                                   "apd_max_lookahead", "cache"]


def test_sampled_apd_fills_the_canvas(tiny_llada_artifacts, tiny_verifier_artifacts):
    async def main():
        config = ServiceConfig(Artifacts.in_directory(tiny_llada_artifacts),
                               apd_verifier=Artifacts.in_directory(tiny_verifier_artifacts))
        service = await GenerateService(config).start()
        outs = []
        for seed in (3, 3):
            params = SamplingParams(max_tokens=16, temperature=0.7, seed=seed, ignore_eos=True,
                                    diffusion=DiffusionParams(apd_mixture_weight=0.7, apd_max_lookahead=4))
            tokens = []
            async for event in service.generate(PROMPT, params):
                tokens += event.token_ids
            outs.append(tokens)
        await service.stop()
        return outs

    first, again = asyncio.run(main())
    assert first == again and len(first) == 16 and MASK_ID not in first and np.all(np.array(first) >= 0)
