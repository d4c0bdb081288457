"""`kiln serve` on a diffusion LM (the tiny LLaDA): the OpenAI routes, /generate and /ws with the
diffusion fields, usage in forward passes, metrics, aborts, and the 400s for what makes no sense."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
import torch
import websockets

from kiln.export.export_model import build_model
from kiln.export.options import ExportOptions
from kiln.models.loader import load_checkpoint
from tests.diffusion_reference import generate

pytestmark = pytest.mark.e2e
PROMPT = [5, 9, 200, 31, 7, 100, 42]
DUAL = {"steps": 16, "block_length": 8, "cache": "dual", "threshold": 0.3}


@pytest.fixture(scope="module")
def llada_server(start_server, tiny_llada_artifacts):
    return start_server("--artifacts", tiny_llada_artifacts, "--served-model-name", "llada")


@pytest.fixture(scope="module")
def client(llada_server):
    with openai.OpenAI(base_url=llada_server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def reference_tokens(tiny_llada_hf):
    checkpoint = load_checkpoint(tiny_llada_hf)
    model = build_model(checkpoint, ExportOptions().validate(256))
    with torch.no_grad():
        return generate(model, PROMPT, gen_length=32, block_length=8, steps=16, mask_id=4, cache="dual",
                        threshold=0.3)


def test_completions_match_the_reference_with_usage_in_forward_passes(client, llada_server, reference_tokens):
    response = client.completions.create(model="llada", prompt=PROMPT, max_tokens=32,
                                         extra_body={**DUAL, "ignore_eos": True})
    [choice] = response.choices
    usage = response.model_dump()["usage"]
    assert choice.finish_reason == "length"
    assert usage["completion_tokens"] == 32 and usage["canvas_tokens"] == 32
    assert usage["forward_passes"] == reference_tokens.forward_passes
    assert usage["tokens_per_forward"] == round(32 / reference_tokens.forward_passes, 3)
    detokenized = httpx.post(llada_server.url + "/detokenize", json={"tokens": reference_tokens.tokens}).json()
    assert choice.text == detokenized["prompt"]


def test_streamed_deltas_join_to_the_whole_text(client):
    body = {**DUAL, "ignore_eos": True, "num_denoising_steps": 16}  # dfastllm's name for steps, agreeing
    whole = client.completions.create(model="llada", prompt=PROMPT, max_tokens=32, extra_body=body)
    chunks = list(client.completions.create(model="llada", prompt=PROMPT, max_tokens=32, stream=True,
                                            stream_options={"include_usage": True}, extra_body=body))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) > 1  # committed prefixes stream out
    assert chunks[-1].model_dump()["usage"]["forward_passes"] == whole.model_dump()["usage"]["forward_passes"]


def test_max_tokens_rounds_up_to_whole_blocks_and_chat_works(client):
    response = client.completions.create(model="llada", prompt=PROMPT, max_tokens=20,
                                         extra_body={"block_length": 8, "ignore_eos": True, "parallel_decoding": True})
    usage = response.model_dump()["usage"]
    assert usage["canvas_tokens"] == 24 and usage["completion_tokens"] == 24
    chat = client.chat.completions.create(model="llada", messages=[{"role": "user", "content": "Hi"}], max_tokens=16,
                                          extra_body={"cache": "prefix", "threshold": 0.5})
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert chat.model_dump()["usage"]["forward_passes"] >= 1


def test_generate_route_and_websocket(llada_server):
    body = {"input_ids": PROMPT, "sampling_params": {"max_completion_tokens": 16, "ignore_eos": True, **DUAL},
            "return_input_ids": True}
    response = httpx.post(llada_server.url + "/generate", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert len(response.json()) == 16  # shortfin's return_input_ids: the generated ids

    async def socket():
        url = llada_server.url.replace("http", "ws") + "/ws"
        async with websockets.connect(url) as ws:
            await ws.send(json.dumps({"type": "generate", "id": "a", "input_ids": PROMPT, "max_tokens": 16,
                                      "ignore_eos": True, **DUAL}))
            while (message := json.loads(await ws.recv()))["type"] != "done":
                assert message["type"] == "token", message
            return message

    done = asyncio.run(socket())
    assert done["usage"]["forward_passes"] >= 1 and done["usage"]["completion_tokens"] == 16


@pytest.mark.parametrize("extra,param", [
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"logprobs": 2}, "logprobs"),
    ({"logit_bias": {"7": 2}}, "logit_bias"),
    ({"top_p": 0.9}, "top_p"),
    ({"steps": 7, "block_length": 8}, "steps"),
    ({"block_length": 0}, "block_length"),
    ({"remasking": "sometimes"}, "remasking"),
    ({"confidence": "vibes"}, "confidence"),
    ({"cache": "both"}, "cache"),
    ({"threshold": 1.5}, "threshold"),
    ({"cfg_scale": 1.0, "cache": "dual"}, "cfg_scale"),
    ({"steps": 16, "num_denoising_steps": 8}, "num_denoising_steps"),
    ({"apd_mixture_weight": 0.5}, "apd_mixture_weight"),
    ({"max_tokens": 1000}, "max_tokens"),
    ({"guided_regex": "a+"}, "guided_regex"),
])
def test_what_makes_no_sense_is_a_400_naming_the_field(llada_server, extra, param):
    body = {"model": "llada", "prompt": "Hello", "max_tokens": 16, **extra}
    response = httpx.post(llada_server.url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_an_autoregressive_server_refuses_diffusion_fields(tiny_server):
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "steps": 8}
    response = httpx.post(tiny_server.url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "steps"


def test_aborted_streams_return_every_page_and_metrics_count_passes(llada_server):
    body = {"model": "llada", "prompt": PROMPT, "max_tokens": 96, "steps": 96, "block_length": 32,
            "ignore_eos": True, "stream": True}
    for _ in range(3):
        with httpx.stream("POST", llada_server.url + "/v1/completions", json=body, timeout=30) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    break  # the first committed text, then hang up
    assert llada_server.wait_metric("kiln_kv_pages_active", 0) == 0
    assert llada_server.metric('kiln_diffusion_forward_passes_total{kind="dual"}') > 0
    assert llada_server.metric('kiln_diffusion_forward_passes_total{kind="full"}') > 0
    assert llada_server.metric("kiln_diffusion_tokens_per_forward_count") > 0
    assert llada_server.metric('kiln_model_steps_total{kind="denoise"}') > 0


def test_apd_through_kiln_serve(start_server, tiny_llada_artifacts, tiny_verifier_artifacts):
    server = start_server("--artifacts", tiny_llada_artifacts, "--apd-verifier", tiny_verifier_artifacts,
                          "--served-model-name", "llada-apd")
    body = {"model": "llada-apd", "prompt": PROMPT, "max_tokens": 24, "ignore_eos": True,
            "apd_mixture_weight": 1.0, "apd_max_lookahead": 6}
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["completion_tokens"] == 24 and usage["forward_passes"] == 4  # six tokens accepted per round
    bad = httpx.post(server.url + "/v1/completions", json={**body, "apd_kv_window": 0}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "apd_kv_window"
    assert server.metric('kiln_diffusion_forward_passes_total{kind="apd"}') == 4
    assert server.metric('kiln_model_steps_total{kind="verify"}') == 4
