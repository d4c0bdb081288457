"""benchmarks/embedding_bench.py's workload and client, against `kiln serve` on the tiny embedding model."""

from __future__ import annotations

import httpx
import numpy as np

from benchmarks.embedding_bench import embed_all, inputs


def test_the_workload_is_fixed_and_every_input_comes_back_in_order(start_server, tiny_embedding_artifacts):
    texts = inputs(10)
    assert texts == inputs(10) and all(10 <= len(text.split()) <= 120 for text in texts)
    server = start_server("--artifacts", tiny_embedding_artifacts, "--served-model-name", "model")
    texts = [text[:100] for text in texts]  # within the tiny model's context of 256 tokens
    vectors, tokens, seconds = embed_all(server.url, "model", texts, batch=3)
    assert len(vectors) == 10 and seconds > 0
    assert tokens == sum(httpx.post(server.url + "/tokenize", json={"prompt": text}).json()["count"] for text in texts)
    alone = embed_all(server.url, "model", texts[7:8], batch=1)[0][0]
    np.testing.assert_allclose(vectors[7], alone, atol=1e-5)  # rows come back in input order
