"""Many LoRA adapters over one compiled model: the tiny model exported with 2 adapter slots (rank
up to 8, q/v/o/down projections), against the same model with each adapter merged into its
weights in float32 (PyTorch eager), through the compiled functions, the engine and real HTTP.

Adapters are random, in PEFT's on-disk format (adapter_config.json, adapter_model.safetensors).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from safetensors.numpy import save_file

from kiln.runtime import GenerateService, ServiceConfig
from kiln.runtime.contract import Artifacts
from kiln.runtime.sampling import SamplingParams
from tests.server_process import free_port

MODULES = {"q_proj": (64, 64), "v_proj": (64, 32), "o_proj": (64, 64), "down_proj": (128, 64)}
PROMPT = "The quick brown fox jumps over the lazy dog"
TOKENS = 12


def write_adapter(directory: Path, seed: int, rank: int, alpha: float, modules=MODULES, **config) -> dict:
    """A random adapter in PEFT's format; its tensors by PEFT's names."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for layer in range(2):
        for module, (fin, fout) in modules.items():
            block = "mlp" if module == "down_proj" else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{key}.lora_A.weight"] = (rng.normal(size=(rank, fin)) * 0.2).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (rng.normal(size=(fout, rank)) * 0.2).astype(np.float32)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(modules), "bias": "none",
         **config}))
    return tensors


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, tuple[Path, float]]:
    """Three adapters (more than the build's two slots): name -> (directory, scale)."""
    root = tmp_path_factory.mktemp("adapters")
    made = {}
    for seed, (name, rank, alpha) in enumerate([("sql", 8, 16), ("poet", 4, 4), ("chat", 2, 8)], start=1):
        write_adapter(root / name, seed, rank, alpha)
        made[name] = (root / name, alpha / rank)
    return made


@pytest.fixture(scope="module")
def merged(tiny_checkpoint, adapters):
    """greedy(name, ids): PyTorch eager's greedy tokens on the model with that adapter merged (None: none)."""
    import torch

    from kiln.models.llama import PagedLlama
    from kiln.runtime.safetensors_file import read_float_tensors

    def model(name):
        tensors = dict(tiny_checkpoint.tensors)
        if name is not None:
            directory, scale = adapters[name]
            lora = read_float_tensors(directory / "adapter_model.safetensors")
            for key, a in lora.items():
                if key.endswith("lora_A.weight"):
                    weight = key.replace("base_model.model.", "").replace(".lora_A.weight", ".weight")
                    tensors[weight] = tensors[weight] + scale * lora[key.replace("lora_A", "lora_B")] @ a
        return PagedLlama(tiny_checkpoint.config).load_tensors(tensors).eval()

    models = {}

    def greedy(name, ids, count=TOKENS):
        built = models.setdefault(name, model(name))
        ids = list(ids)
        with torch.no_grad():
            for _ in range(count):
                ids.append(int(built.forward_reference(torch.tensor([ids]))[0, -1].argmax()))
        return ids[-count:]

    return greedy


def test_a_mixed_batch_runs_each_row_with_its_own_adapter(tiny_lora_artifacts, adapters, merged):
    async def run():
        config = ServiceConfig(Artifacts.in_directory(tiny_lora_artifacts),
                               lora_adapters={name: str(path) for name, (path, _) in adapters.items()})
        service = await GenerateService(config).start()
        try:
            prompt = service.encode(PROMPT)
            params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)

            async def one(name):
                tokens = []
                async for event in service.generate(prompt, replace(params, lora=name)):
                    tokens += event.token_ids
                return tokens

            together = await asyncio.gather(one(None), one("sql"), one("poet"), one("sql"))
            # A third adapter takes the slot of the least recently used one no request holds.
            after = [await one(name) for name in ("chat", "poet", "sql", None)]
            return prompt, together, after, service.stats()
        finally:
            await service.stop()

    prompt, together, after, stats = asyncio.run(run())
    expected = {name: merged(name, prompt) for name in (None, "sql", "poet", "chat")}
    assert together == [expected[None], expected["sql"], expected["poet"], expected["sql"]]
    assert after == [expected["chat"], expected["poet"], expected["sql"], expected[None]]
    assert len({tuple(tokens) for tokens in expected.values()}) == 4  # the adapters do change the output
    assert stats.prefix_hit_tokens > 0  # repeats of one adapter share its pages, never another's


@pytest.fixture(scope="module")
def server(start_server, tiny_lora_artifacts, adapters):
    grpc_port = free_port()
    server = start_server("--artifacts", tiny_lora_artifacts, "--served-model-name", "tiny", "--grpc-port", grpc_port,
                          "--lora", f"sql={adapters['sql'][0]}", f"poet={adapters['poet'][0]}")
    server.artifacts, server.grpc_port = tiny_lora_artifacts, grpc_port
    return server


def test_the_openai_sdk_picks_an_adapter_by_model(server, merged):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    cards = {card.id: card for card in client.models.list().data}
    assert set(cards) == {"tiny", "sql", "poet"} and cards["sql"].parent == "tiny"
    ids = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    for model in ("tiny", "sql", "poet"):
        answer = client.completions.create(model=model, prompt=ids, max_tokens=TOKENS, temperature=0,
                                           extra_body={"ignore_eos": True})
        assert answer.model == model
        assert answer.choices[0].text == _detokenize(server, merged(None if model == "tiny" else model, ids))


def _detokenize(server, ids) -> str:
    """The text the server sends for `ids` (special tokens left out)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(server.artifacts / "tokenizer.json")).decode(ids, skip_special_tokens=True)


def test_kserves_model_name_picks_an_adapter(server, merged):
    import tritonclient.grpc as triton

    from tests.server.test_front_doors import kserve_inputs

    ids = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    client = triton.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    sampling = json.dumps({"max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}).encode()
    for model in ("tiny", "sql"):
        inputs = kserve_inputs(sampling, PROMPT.encode())
        inputs.append(_exclude_input(triton))
        answer = client.infer(model, inputs).as_numpy("text_output")[0].decode()
        assert answer == _detokenize(server, merged(None if model == "tiny" else model, ids))


def _exclude_input(triton):
    tensor = triton.InferInput("exclude_input_in_output", [1], "BOOL")
    tensor.set_data_from_numpy(np.array([True]))
    return tensor


def test_adapters_load_and_unload_while_serving(server, adapters, merged, tmp_path):
    url = server.url
    loaded = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": str(adapters["chat"][0])})
    assert loaded.status_code == 200 and "chat" in loaded.text
    ids = httpx.post(url + "/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    body = {"model": "chat", "prompt": ids, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
    answer = httpx.post(url + "/v1/completions", json=body).json()
    assert answer["choices"][0]["text"] == _detokenize(server, merged("chat", ids))
    assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "chat"}).status_code == 200
    gone = httpx.post(url + "/v1/completions", json=body)
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "model"
    assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "chat"}).status_code == 404


@pytest.mark.parametrize("change, message", [
    (dict(rank=16, alpha=16), "rank 16, more than this server's --max-lora-rank 8"),
    (dict(modules={"k_proj": (64, 32)}), "adapts k_proj, which this build does not"),
    (dict(modules={"q_proj": (64, 48)}), "needs A"),
    (dict(use_dora=True), "DoRA"),
])
def test_an_adapter_that_does_not_fit_is_a_400_naming_why(server, tmp_path, change, message):
    options = {"seed": 9, "rank": 4, "alpha": 8} | change
    write_adapter(tmp_path / "bad", **options)
    answer = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(tmp_path / "bad")})
    assert answer.status_code == 400 and message in answer.json()["error"]["message"]
    assert answer.json()["error"]["param"] == "lora_path"
    missing = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path / "none")})
    assert missing.status_code == 400
    taken = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": str(tmp_path / "bad")})
    assert taken.status_code == 400 and "already loaded" in taken.json()["error"]["message"]


def test_a_build_without_slots_refuses_adapters(tiny_server, adapters):
    answer = httpx.post(tiny_server.url + "/v1/load_lora_adapter",
                        json={"lora_name": "sql", "lora_path": str(adapters["sql"][0])})
    assert answer.status_code == 400 and "--max-loras" in answer.json()["error"]["message"]
