"""The disk KV tier on SmolLM2: a restarted server on the same --kv-cache-dir serves a known
1,000-token prefix with only the new tokens prefilled; a damaged file is ignored with a
warning; the admin routes save and restore a prompt's pages by hand."""

from __future__ import annotations

import random

import httpx
import pytest

from kiln.runtime.kvcache.events import block_hash

pytestmark = [pytest.mark.e2e, pytest.mark.smollm2]
KEY = {"Authorization": "Bearer disk-key"}
_RNG = random.Random(11)
PROMPT = [_RNG.randrange(300, 40000) for _ in range(1000)]
STRIDE = 16
CACHED = (len(PROMPT) - 1) // STRIDE * STRIDE  # every page but the one holding the last token


def complete(server) -> dict:
    reply = httpx.post(server.url + "/v1/completions", headers=KEY, timeout=120,
                       json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    return {"text": body["choices"][0]["text"], "cached": body["usage"]["prompt_tokens_details"]["cached_tokens"]}


@pytest.fixture(scope="module")
def serve_on(start_server, smollm2_artifacts, tmp_path_factory):
    directory = tmp_path_factory.mktemp("kv-cache-dir")

    def start():
        return start_server("--artifacts", smollm2_artifacts, "--kv-cache-dir", directory, "--host-kv-size", "96MiB",
                            "--api-key", "disk-key")

    start.directory = directory
    return start


def test_a_restarted_server_serves_a_known_prefix_from_disk(serve_on, caplog):
    first = serve_on()
    cold = complete(first)
    assert cold["cached"] == 0
    assert first.stop() == 0  # drained: every page it cached is on disk
    second = serve_on()
    warm = complete(second)
    assert warm == {"text": cold["text"], "cached": CACHED}  # only the new tokens prefilled, same tokens out
    assert second.metric('kiln_prefix_cache_tier_tokens_total{tier="disk"}') == CACHED
    assert second.metric('kiln_kv_disk_pages_total{event="read"}') == CACHED // STRIDE
    assert second.metric("kiln_kv_disk_pages_stored") == len(PROMPT) // STRIDE  # the first server's, found
    assert second.stop() == 0

    # A damaged first page: nothing of the prefix is served from disk, and the log says why.
    first_page = block_hash(None, tuple(PROMPT[:STRIDE])) & (2**64 - 1)
    [path] = list(serve_on.directory.glob(f"*/{first_page:016x}.kvpage"))
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    third = serve_on()
    assert complete(third) == {"text": cold["text"], "cached": 0}
    assert "ignoring KV cache file" in third.log() and "corrupt" in third.log()
    assert third.metric('kiln_kv_disk_pages_total{event="refused"}') == 1
    assert third.metric("kiln_kv_disk_pages_stored") == len(PROMPT) // STRIDE  # the bad one removed, then saved again

    # Saved again by hand (the page was recomputed and is cached now), restored by hand after a restart.
    path.unlink()
    saved = httpx.post(third.url + "/admin/kv-cache/save", headers=KEY, json={"input_ids": PROMPT}, timeout=120)
    assert saved.status_code == 200 and saved.json()["pages"] == len(PROMPT) // STRIDE, saved.text
    assert httpx.post(third.url + "/admin/kv-cache/save", json={"input_ids": PROMPT}, timeout=30).status_code == 401
    assert third.stop() == 0
    fourth = serve_on()
    restored = httpx.post(fourth.url + "/admin/kv-cache/restore", headers=KEY, json={"input_ids": PROMPT}, timeout=60)
    assert restored.json() == {"prompt_tokens": 1000, "pages": 62, "tokens": 992}
    assert complete(fourth) == {"text": cold["text"], "cached": CACHED}
    bad = httpx.post(fourth.url + "/admin/kv-cache/restore", headers=KEY, json={"prompt": "x", "input_ids": [1]})
    assert bad.status_code == 400


def test_admin_routes_without_a_disk_tier_are_a_400(start_server, smollm2_artifacts):
    server = start_server("--artifacts", smollm2_artifacts)
    reply = httpx.post(server.url + "/admin/kv-cache/save", json={"prompt": "hello"}, timeout=30)
    assert reply.status_code == 400 and "--kv-cache-dir" in reply.json()["error"]["message"]
    server.stop()
