"""Beam search over HTTP on the compiled tiny model: /generate's num_beams (shortfin) and the
OpenAI routes' use_beam_search (vLLM) give a textbook beam search's beams, ranked."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest
import torch

from kiln.export.export_model import build_model
from kiln.export.options import ExportOptions
from kiln.models.loader import load_checkpoint

pytestmark = pytest.mark.e2e
PROMPT = [5, 9, 200, 31, 7, 100, 42, 17, 3]
WIDTH, LENGTH = 4, 5


@torch.no_grad()
def reference_beams(model, prompt, width, length):
    """Keep the `width` best continuations by summed log-probability, EOS ignored."""
    beams = [([], 0.0)]
    for _ in range(length):
        batch = torch.tensor([list(prompt) + tokens for tokens, _ in beams])
        rows = torch.log_softmax(model.forward_reference(batch)[:, -1].double(), -1).numpy()
        expanded = [(tokens + [t], score + float(rows[i, t])) for i, (tokens, score) in enumerate(beams)
                    for t in range(rows.shape[1])]
        expanded.sort(key=lambda b: -b[1])
        beams = expanded[:width]
    return beams


@pytest.fixture(scope="module")
def reference(tiny_hf_dir):
    model = build_model(load_checkpoint(tiny_hf_dir), ExportOptions().validate(256))
    return reference_beams(model, PROMPT, WIDTH, LENGTH)


def test_generate_num_beams_returns_the_reference_beams_ranked(tiny_server, reference):
    body = {"input_ids": PROMPT, "return_input_ids": True,
            "sampling_params": {"max_completion_tokens": LENGTH, "num_beams": WIDTH, "use_beam_search": True,
                                "ignore_eos": True}}
    ids = httpx.post(tiny_server.url + "/generate", json=body, timeout=60).json()
    assert ids == [tokens for tokens, _ in reference]
    body.pop("return_input_ids")
    responses = httpx.post(tiny_server.url + "/generate", json=body, timeout=60).json()["responses"][0]["responses"]
    logprobs = [r["cumulative_logprob"] for r in responses]
    assert np.allclose(logprobs, [score for _, score in reference], atol=1e-3)
    assert logprobs == sorted(logprobs, reverse=True)


def test_openai_use_beam_search_returns_the_best_n(tiny_server, reference):
    with openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        extra = {"use_beam_search": True, "best_of": WIDTH, "ignore_eos": True}
        completion = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=LENGTH, n=2, logprobs=None,
                                               extra_body=extra)
        texts = [c.text for c in completion.choices]
        assert len(texts) == 2 and completion.usage.completion_tokens == 2 * LENGTH
        ids = httpx.post(tiny_server.url + "/generate", timeout=60, json={
            "input_ids": PROMPT, "return_input_ids": False, "sampling_params": {
                "max_completion_tokens": LENGTH, "num_beams": WIDTH, "use_beam_search": True, "ignore_eos": True}})
        assert texts == [r["text"] for r in ids.json()["responses"][0]["responses"][:2]]
        streamed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=LENGTH, n=2, stream=True,
                                             extra_body=extra)
        joined = ["", ""]
        for chunk in streamed:
            for choice in chunk.choices:
                joined[choice.index] += choice.text
        assert joined == texts
        for bad, field in (({"use_beam_search": True, "best_of": 1, "n": 2}, "n"),
                           ({"use_beam_search": True, "best_of": 4, "stop": ["x"]}, "stop"),
                           ({"best_of": 3}, "best_of")):
            with pytest.raises(openai.BadRequestError) as caught:
                client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3,
                                          **{k: v for k, v in bad.items() if k in ("n", "stop", "best_of")},
                                          extra_body={k: v for k, v in bad.items() if k == "use_beam_search"})
            assert field in str(caught.value)
