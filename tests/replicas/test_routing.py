"""The front's parts that need no Ray: routing keys, the prefix table's choice, the ASGI bridge."""

from __future__ import annotations

import asyncio
import json

import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from kiln.runtime.kvcache.events import block_hash
from kiln.server.replicas.asgi_bridge import ForwardedRequest, ResponseStart, call_app
from kiln.server.replicas.prefix_table import PrefixTable, RoutingPolicy, choose
from kiln.server.replicas.routing_key import RoutingKeys, page_hashes


def test_page_hashes_chain_whole_pages_as_the_prefix_cache_does():
    ids = list(range(40))
    hashes = page_hashes(ids, 16)
    assert len(hashes) == 2  # the partial third page is never shared
    assert hashes[0] == block_hash(None, tuple(range(16)))
    assert hashes[1] == block_hash(hashes[0], tuple(range(16, 32)))
    assert page_hashes(ids[:15], 16) == []
    assert page_hashes([99, *ids[1:]], 16)[1] != hashes[1]  # a different first page changes every later hash


@pytest.fixture(scope="module")
def keys(tiny_hf_dir) -> RoutingKeys:
    return RoutingKeys(tiny_hf_dir / "tokenizer.json", page_tokens=4)


def _body(value) -> bytes:
    return json.dumps(value).encode()


def test_routing_keys_read_each_api_prompt_as_its_route_would(keys):
    text = "Machine learning models read text as tokens; a tokenizer turns words into numbers."
    ids = keys.tokenizer.encode(text).ids
    completion = keys.of_request("/v1/completions", _body({"prompt": text}))
    assert completion == page_hashes(ids, 4) and completion
    assert keys.of_request("/v1/completions", _body({"prompt": [text, "other"]})) == completion
    assert keys.of_request("/v1/completions", _body({"prompt": ids})) == completion
    assert keys.of_request("/generate", _body({"text": text})) == completion
    assert keys.of_request("/generate", _body({"input_ids": ids})) == completion
    messages = [{"role": "system", "content": text}, {"role": "user", "content": "hi"}]
    chat = keys.of_request("/v1/chat/completions", _body({"messages": messages}))
    longer = keys.of_request("/v1/chat/completions", _body({"messages": [*messages, {"role": "user", "content": "more"}]}))
    assert len(chat) > 4 and longer[:len(chat) - 2] == chat[:-2]  # one conversation, one growing prefix
    responses = keys.of_request("/v1/responses", _body({"input": "hi", "instructions": text}))
    assert responses[:2] == keys.of_request("/v1/chat/completions", _body({"messages": [
        {"role": "system", "content": text}, {"role": "user", "content": "hi"}]}))[:2]


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", b"{not json"),
    ("/v1/completions", _body({"prompt": 5})),
    ("/v1/chat/completions", _body({"messages": "hi"})),
    ("/v1/chat/completions", _body({"messages": [{"role": "user", "content": "x"}],
                                    "chat_template_kwargs": {"messages": 1}})),
    ("/v1/models", b""),
    ("/generate", _body([1, 2])),
])
def test_a_request_the_front_cannot_read_gets_no_key(keys, path, body):
    assert keys.of_request(path, body) == []


def test_cache_aware_prefers_the_replica_holding_the_prefix_while_loads_are_even():
    policy, table = RoutingPolicy(imbalance=2), PrefixTable(100)
    prefix = page_hashes(list(range(64)), 16)
    table.record("b", prefix)
    assert choose(policy, table, prefix + [7], {"a": 0, "b": 2})[0] == "b"
    assert choose(policy, table, prefix, {"a": 0, "b": 3})[0] == "a"  # imbalanced: the least loaded
    # A prefix nobody holds goes to the replica holding the fewest pages.
    assert choose(policy, table, page_hashes(list(range(100, 164)), 16), {"a": 1, "b": 0})[0] == "a"


def test_a_short_match_does_not_outweigh_spreading_the_pages():
    policy, table = RoutingPolicy(min_match=0.5), PrefixTable(100)
    hashes = page_hashes(list(range(160)), 16)
    table.record("a", hashes[:2])
    table.record("a", page_hashes(list(range(500, 600)), 16))
    assert choose(policy, table, hashes, {"a": 0, "b": 0})[0] == "b"
    table.record("a", hashes[:6])
    assert choose(policy, table, hashes, {"a": 0, "b": 0})[0] == "a"


def test_the_table_forgets_least_recently_routed_pages_beyond_a_replicas_share():
    table = PrefixTable(pages_per_replica=4)
    old, new = page_hashes(list(range(48)), 16), page_hashes(list(range(100, 148)), 16)
    table.record("a", old)
    table.record("a", new)
    assert table.page_count("a") == 4
    # The old prefix loses its deepest pages first: its leading page still matches.
    assert table.matched_pages("a", new) == 3 and table.matched_pages("a", old) == 1
    table.record("a", page_hashes(list(range(200, 248)), 16))
    assert table.matched_pages("a", old) == 0 and table.matched_pages("a", new) == 1


def test_a_prefix_in_use_keeps_its_leading_pages_while_follow_ups_overflow_the_share():
    """Follow-ups each add a page of their own; the shared prefix they all start with stays
    matched from its first page, so they keep going to the replica holding it."""
    table = PrefixTable(pages_per_replica=12)
    prefix = list(range(160))
    table.record("a", page_hashes(prefix, 16))
    for n in range(8):
        table.record("a", page_hashes(prefix + list(range(1000 + 16 * n, 1016 + 16 * n)), 16))
        table.record("a", page_hashes(list(range(5000 + 32 * n, 5032 + 32 * n)), 16))  # other prefixes
    assert table.matched_pages("a", page_hashes(prefix, 16)) >= 5


def test_round_robin_takes_turns():
    policy, table = RoutingPolicy("round_robin"), PrefixTable(10)
    loads = {"a": 0, "b": 5, "c": 0}
    assert [choose(policy, table, [], loads, turn)[0] for turn in range(4)] == ["a", "b", "c", "a"]
    with pytest.raises(ValueError, match="routing policy"):
        RoutingPolicy("random")


def _app(aborted: asyncio.Event) -> Starlette:
    async def echo(request):
        return JSONResponse({"path": request.url.path, "query": request.url.query,
                             "body": (await request.body()).decode(), "auth": request.headers.get("authorization")},
                            status_code=201)

    async def endless(request):
        async def chunks():
            try:
                for n in range(10**6):
                    yield f"{n}\n".encode()
                    await asyncio.sleep(0.01)
            finally:
                aborted.set()

        return StreamingResponse(chunks())

    return Starlette(routes=[Route("/echo", echo, methods=["POST"]), Route("/endless", endless)])


def _request(path: str, body: bytes = b"", method: str = "POST") -> ForwardedRequest:
    return ForwardedRequest(method, path, b"a=1", ((b"authorization", b"Bearer k"),), body, ("127.0.0.1", 5))


def test_the_bridge_gives_the_apps_response_as_plain_data():
    async def run():
        items = [item async for item in call_app(_app(asyncio.Event()), _request("/echo", b"hello"))]
        start, body = items[0], b"".join(items[1:])
        assert isinstance(start, ResponseStart) and start.status == 201
        assert json.loads(body) == {"path": "/echo", "query": "a=1", "body": "hello", "auth": "Bearer k"}

    asyncio.run(run())


def test_a_caller_that_stops_reading_disconnects_the_client():
    async def run():
        aborted = asyncio.Event()
        stream = call_app(_app(aborted), _request("/endless", method="GET"))
        assert isinstance(await stream.__anext__(), ResponseStart)
        assert await stream.__anext__() == b"0\n"
        await stream.aclose()  # what Ray does when the front cancels the call
        await asyncio.wait_for(aborted.wait(), 5)

    asyncio.run(run())
