"""A server on a byte KV cache (the tiny model built with --kv-cache-dtype int8, or fp8): a prefix
served from its disk tier after a restart gives the same tokens as the first, cold request, so
the pages' scales travel with them through the host and disk tiers."""

from __future__ import annotations

import random

import httpx
import pytest

pytestmark = pytest.mark.e2e
_RNG = random.Random(5)
PROMPT = [_RNG.randrange(1, 380) for _ in range(150)]
STRIDE = 16
CACHED = (len(PROMPT) - 1) // STRIDE * STRIDE  # every page but the one holding the last token


def complete(server) -> dict:
    reply = httpx.post(server.url + "/v1/completions", timeout=120,
                       json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 1})
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    return {"tokens": choice["logprobs"]["tokens"], "cached": reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]}


@pytest.mark.parametrize("build", ["tiny_int8_kv_artifacts", "tiny_fp8_kv_artifacts"])
def test_a_byte_cache_comes_back_from_disk_with_the_same_tokens(build, request, start_server, tmp_path_factory):
    artifacts = request.getfixturevalue(build)
    directory = tmp_path_factory.mktemp("byte-kv-cache-dir")

    def serve():
        return start_server("--artifacts", artifacts, "--kv-cache-dir", directory,
                            "--host-kv-size", "4MiB")

    first = serve()
    cold = complete(first)
    assert cold["cached"] == 0
    assert first.stop() == 0  # drained: every page it cached is on disk
    second = serve()
    warm = complete(second)
    assert warm == {"tokens": cold["tokens"], "cached": CACHED}
    assert second.metric('kiln_prefix_cache_tier_tokens_total{tier="disk"}') == CACHED
    again = complete(second)  # now from the device's own pages
    assert again == warm
    assert second.stop() == 0
