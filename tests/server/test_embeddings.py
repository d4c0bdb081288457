"""Embeddings from a compiled model: the engine's pooled hidden states against Hugging Face
transformers' (cosine >= 0.9999), and /v1/embeddings, /v1/score and /rerank over real HTTP with
the openai SDK and LangChain unchanged.

The model is the tiny random Llama as a sentence-transformers model (last-token pooling, then
normalised, Matryoshka sizes 16 and 32), exported with --embeddings. Prompts longer than a
prefill chunk are written in several embed calls; a repeated prompt's prefix comes from the cache.
"""

from __future__ import annotations

import asyncio
import base64
import threading

import httpx
import numpy as np
import openai
import pytest

from kiln.runtime import GenerateService, ServiceConfig
from kiln.runtime.contract import Artifacts

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world!",
    # Longer than a chunk of 32 tokens, so it is written in several embed calls.
    "Once upon a time, in a small village by the sea, there lived an old fisherman and his wife. " * 3,
]


@pytest.fixture(scope="module")
def reference(tiny_embedding_hf):
    """transformers' final hidden states of a prompt's ids, [T, H]."""
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(tiny_embedding_hf).eval()

    def hidden(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            return model(torch.tensor([ids])).last_hidden_state[0].numpy().astype(np.float64)

    return hidden


def pooled(hidden: np.ndarray, mode: str, dimensions: int | None = None) -> np.ndarray:
    vector = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[mode][:dimensions]
    return vector / np.linalg.norm(vector)


def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.mark.parametrize("mode", ["last", "mean", "cls"])
def test_the_engines_embeddings_are_transformers_pooled_outputs(tiny_embedding_artifacts, reference, mode):
    async def run():
        config = ServiceConfig(Artifacts.in_directory(tiny_embedding_artifacts), pooling=mode, chunk_tokens=32)
        service = await GenerateService(config).start()
        try:
            prompts = [service.encode(text) for text in TEXTS]
            first = await service.embed(prompts, service.pooling())
            again = await service.embed(prompts, service.pooling())  # their prefixes now cached
            return prompts, first, again, service.stats()
        finally:
            await service.stop()

    prompts, first, again, stats = asyncio.run(run())
    assert len(prompts[2]) > 64  # three calls or more
    for ids, vector, repeated in zip(prompts, first, again):
        assert vector.shape == (64,) and vector.dtype == np.float32
        assert cosine(vector, pooled(reference(ids), mode)) >= 0.9999
        assert np.linalg.norm(vector) == pytest.approx(1.0, abs=1e-5)
        assert cosine(repeated, vector) >= 0.9999
    assert stats.steps["embed"] >= 6 and stats.steps["prefill"] == stats.steps["decode"] == 0
    # Last-token pooling skips a cached prefix; mean and CLS pooling read every position.
    assert (stats.prefix_hit_tokens > 0) == (mode == "last")


def test_the_offline_api_embeds_text_and_token_ids(tiny_embedding_artifacts, reference):
    from kiln.runtime import LLM

    with LLM(tiny_embedding_artifacts) as llm:
        ids = llm.service.encode(TEXTS[0])
        by_text, by_ids = llm.embed([TEXTS[0], ids])
        cut = llm.embed(TEXTS[0], dimensions=16)[0]
    np.testing.assert_allclose(by_text, by_ids, atol=1e-6)
    assert cosine(by_text, pooled(reference(ids), "last")) >= 0.9999
    assert cut.shape == (16,) and cosine(cut, pooled(reference(ids), "last", 16)) >= 0.9999


@pytest.fixture(scope="module")
def server(start_server, tiny_embedding_artifacts):
    return start_server("--artifacts", tiny_embedding_artifacts, "--served-model-name", "tiny-embed",
                        "--max-prefill-tokens", "32")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def ids_of(server, text: str) -> list[int]:
    return httpx.post(server.url + "/tokenize", json={"prompt": text}).json()["tokens"]


def test_the_openai_sdk_gets_transformers_embeddings_in_base64_and_floats(server, client, reference):
    # The SDK asks for base64 unless told otherwise, and decodes it itself.
    answer = client.embeddings.create(model="tiny-embed", input=TEXTS)
    assert [d.index for d in answer.data] == [0, 1, 2] and answer.model == "tiny-embed"
    prompts = [ids_of(server, text) for text in TEXTS]
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == sum(map(len, prompts))
    for ids, data in zip(prompts, answer.data):
        assert cosine(data.embedding, pooled(reference(ids), "last")) >= 0.9999
    floats = client.embeddings.create(model="tiny-embed", input=TEXTS[1], encoding_format="float")
    np.testing.assert_allclose(floats.data[0].embedding, answer.data[1].embedding, atol=1e-6)
    raw = httpx.post(server.url + "/v1/embeddings", json={"input": TEXTS[1], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(decoded, floats.data[0].embedding, atol=1e-6)


def test_token_ids_embed_as_their_text_does(server, client):
    ids = ids_of(server, TEXTS[0])
    by_text = client.embeddings.create(model="tiny-embed", input=TEXTS[0]).data[0].embedding
    by_ids = client.embeddings.create(model="tiny-embed", input=ids).data[0].embedding
    by_lists = client.embeddings.create(model="tiny-embed", input=[ids, ids[:5]]).data
    np.testing.assert_allclose(by_ids, by_text, atol=1e-5)
    np.testing.assert_allclose(by_lists[0].embedding, by_text, atol=1e-5)
    # truncate_prompt_tokens keeps each input's last k tokens, as vLLM's does.
    kept = client.embeddings.create(model="tiny-embed", input=ids, extra_body={"truncate_prompt_tokens": 5})
    tail = client.embeddings.create(model="tiny-embed", input=ids[-5:])
    np.testing.assert_allclose(kept.data[0].embedding, tail.data[0].embedding, atol=1e-5)
    assert kept.usage.prompt_tokens == 5


def test_dimensions_cut_a_matryoshka_model_to_its_trained_sizes(server, client, reference):
    ids = ids_of(server, TEXTS[0])
    for size in (16, 32, 64):
        vector = client.embeddings.create(model="tiny-embed", input=TEXTS[0], dimensions=size).data[0].embedding
        assert len(vector) == size and np.linalg.norm(vector) == pytest.approx(1.0, abs=1e-5)
        assert cosine(vector, pooled(reference(ids), "last", size)) >= 0.9999
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model="tiny-embed", input=TEXTS[0], dimensions=8)
    assert refused.value.body["param"] == "dimensions" and "16, 32" in refused.value.body["message"]


def test_langchains_openai_embeddings_work_unchanged(server, client):
    from langchain_openai import OpenAIEmbeddings

    # check_embedding_ctx_length=False: LangChain otherwise tokenizes with tiktoken's OpenAI
    # vocabulary (fetched from the network), as vLLM's and every local server's docs say.
    embeddings = OpenAIEmbeddings(model="tiny-embed", base_url=server.url + "/v1", api_key="unused",
                                  check_embedding_ctx_length=False)
    documents = embeddings.embed_documents(TEXTS[:2])
    query = embeddings.embed_query(TEXTS[1])
    expected = client.embeddings.create(model="tiny-embed", input=TEXTS[:2]).data
    for got, want in zip(documents, expected):
        np.testing.assert_allclose(got, want.embedding, atol=1e-5)
    np.testing.assert_allclose(query, expected[1].embedding, atol=1e-5)


def test_score_and_rerank_are_the_cosines_of_the_embeddings(server, client):
    vectors = [d.embedding for d in client.embeddings.create(model="tiny-embed", input=TEXTS).data]
    one_to_many = httpx.post(server.url + "/v1/score", json={"model": "tiny-embed", "text_1": TEXTS[0],
                                                             "text_2": TEXTS}).json()
    assert [d["index"] for d in one_to_many["data"]] == [0, 1, 2] and one_to_many["object"] == "list"
    np.testing.assert_allclose([d["score"] for d in one_to_many["data"]],
                               [cosine(vectors[0], v) for v in vectors], atol=1e-5)
    pairwise = httpx.post(server.url + "/score", json={"text_1": TEXTS[:2], "text_2": TEXTS[1:]}).json()
    np.testing.assert_allclose([d["score"] for d in pairwise["data"]],
                               [cosine(vectors[0], vectors[1]), cosine(vectors[1], vectors[2])], atol=1e-5)
    ranked = httpx.post(server.url + "/v1/rerank", json={"query": TEXTS[1], "documents": TEXTS, "top_n": 2}).json()
    assert ranked["results"][0]["index"] == 1 and len(ranked["results"]) == 2
    assert ranked["results"][0]["document"]["text"] == TEXTS[1]
    scores = [r["relevance_score"] for r in ranked["results"]]
    assert scores == sorted(scores, reverse=True)
    bare = httpx.post(server.url + "/rerank", json={"query": "x", "documents": ["y"], "return_documents": False})
    assert "document" not in bare.json()["results"][0]


@pytest.mark.parametrize("path, payload, param", [
    ("/v1/embeddings", {"input": ""}, "input"),
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {"input": [[]]}, "input"),
    ("/v1/embeddings", {"input": [5, 100000]}, "input"),
    ("/v1/embeddings", {"input": "word " * 400}, "input"),  # longer than the context of 256
    ("/v1/embeddings", {"input": ["x"] * 2049}, "input"),
    ("/v1/embeddings", {"input": "x", "dimensions": 0}, "dimensions"),
    ("/v1/embeddings", {"input": "x", "dimensions": 65}, "dimensions"),
    ("/v1/embeddings", {"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ("/v1/embeddings", {"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
    ("/v1/score", {"text_1": "a", "text_2": []}, "text_2"),
    ("/v1/rerank", {"query": "a", "documents": []}, "documents"),
    ("/v1/rerank", {"query": "a", "documents": ["b"], "top_n": 0}, "top_n"),
])
def test_bad_input_is_a_400_naming_the_field(server, path, payload, param):
    answer = httpx.post(server.url + path, json=payload)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param


def test_a_model_built_without_embed_functions_says_how_to_build_one(tiny_server):
    answer = httpx.post(tiny_server.url + "/v1/embeddings", json={"input": "hello"})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "model"
    assert "--embeddings" in answer.json()["error"]["message"]
    assert httpx.post(tiny_server.url + "/v1/score", json={"text_1": "a", "text_2": "b"}).status_code == 400


def test_embeddings_run_beside_generation_without_changing_either(server, client):
    """Embedding prompts and a completion share the engine (their own calls, one cache): the
    completion's greedy tokens and the embeddings are what each gives alone."""
    alone_text = client.completions.create(model="tiny-embed", prompt=TEXTS[0], max_tokens=24, temperature=0,
                                           extra_body={"ignore_eos": True}).choices[0].text
    alone_vectors = [d.embedding for d in client.embeddings.create(model="tiny-embed", input=TEXTS).data]
    results: dict[str, object] = {}

    def embed(index):
        results[index] = [d.embedding for d in client.embeddings.create(model="tiny-embed", input=TEXTS).data]

    threads = [threading.Thread(target=embed, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    together = client.completions.create(model="tiny-embed", prompt=TEXTS[0], max_tokens=24, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text
    for thread in threads:
        thread.join()
    assert together == alone_text
    for vectors in results.values():
        for got, want in zip(vectors, alone_vectors):
            assert cosine(got, want) >= 0.9999
