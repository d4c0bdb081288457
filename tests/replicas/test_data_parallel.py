"""`kiln serve --data-parallel 2` on a local Ray cluster: two replicas of the tiny model, one
core and a small KV cache each, against one single server.

The workload is 8 long shared prefixes with 6 follow-ups each, shuffled and sent 4 at a
time: the cache-aware router keeps each prefix on one replica, round-robin spreads every
prefix over both, and the replicas' own usage (cached tokens) says how much was reused.
"""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.server_process import ServerProcess, free_port

pytestmark = [pytest.mark.ray, pytest.mark.e2e]

KEY = "dp-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
# Per replica: six prefixes (10-12 pages each, the first page common to all) and their
# follow-ups' own pages fit, so a placement skewed while replicas come up does not split one;
# all eight, which round-robin sends to each replica, do not.
PAGES = "72"
TOPICS = ["rivers", "mountains", "forests", "deserts", "oceans", "glaciers", "islands", "volcanoes"]


def _prefix(topic: str) -> str:
    sentence = (f"This is a long shared system prompt about {topic}. Models read text as tokens, and a "
                f"tokenizer turns words about {topic} into numbers and back again. ")
    return sentence * 2


def workload() -> list[str]:
    prompts = [f"{_prefix(topic)}Question {n} about {topic}:" for topic in TOPICS for n in range(6)]
    random.Random(7).shuffle(prompts)
    return prompts


def run_workload(url: str) -> list[dict]:
    """Each prompt's greedy text, usage and replica, in the workload's order."""
    def one(prompt: str) -> dict:
        reply = httpx.post(url + "/v1/completions", headers=AUTH, timeout=120,
                           json={"prompt": prompt, "max_tokens": 4, "temperature": 0})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        return {"text": body["choices"][0]["text"], "prompt_tokens": body["usage"]["prompt_tokens"],
                "cached_tokens": body["usage"]["prompt_tokens_details"]["cached_tokens"],
                "replica": reply.headers.get("x-kiln-replica")}

    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(one, workload()))


def hit_rate(results: list[dict]) -> float:
    return sum(r["cached_tokens"] for r in results) / sum(r["prompt_tokens"] for r in results)


def prefill_tokens(results: list[dict]) -> int:
    return sum(r["prompt_tokens"] - r["cached_tokens"] for r in results)


def start_replicas(start_server, artifacts, routing: str) -> ServerProcess:
    grpc_port = free_port()
    server = start_server("--artifacts", artifacts, "--served-model-name", "tiny", "--kv-cache-pages", PAGES,
                          "--api-key", KEY, "--data-parallel", "2", "--replica-cpus", "1", "--routing", routing,
                          "--grpc-port", str(grpc_port))
    server.grpc = f"127.0.0.1:{grpc_port}"
    _wait_for_replicas(server, 2)
    return server


def _wait_for_replicas(server: ServerProcess, count: int) -> None:
    """Until the front's router sees `count` replicas: /health answers once one replica does,
    and prefixes placed before the second shows up would all land on the first."""
    deadline = time.monotonic() + 120
    while len(_replica_figures(server)) < count:
        assert time.monotonic() < deadline, f"the front did not see {count} replicas:\n{server.log()}"
        time.sleep(0.5)


def test_replicas_that_cannot_load_the_model_end_the_server_with_the_reason(start_server, tiny_artifacts):
    """First in this module: its Ray comes and goes before the others start theirs."""
    server = start_server("--artifacts", tiny_artifacts, "--data-parallel", "2", "--replica-cpus", "1",
                          "--host-kv-size", "10", ready=False)
    assert server.process.wait(180) == 1
    assert "holds no page" in server.log()


@pytest.fixture(scope="module")
def single(start_server, tiny_artifacts) -> ServerProcess:
    return start_server("--artifacts", tiny_artifacts, "--served-model-name", "tiny", "--kv-cache-pages", PAGES,
                        "--api-key", KEY)


@pytest.fixture(scope="module")
def single_results(single) -> list[dict]:
    return run_workload(single.url)


@pytest.fixture(scope="module")
def round_robin_results(start_server, tiny_artifacts, single_results) -> list[dict]:
    """Run and stopped before the cache-aware replicas start: one Ray cluster at a time."""
    server = start_replicas(start_server, tiny_artifacts, "round_robin")
    try:
        return run_workload(server.url)
    finally:
        assert server.stop() == 0, server.log()


@pytest.fixture(scope="module")
def replicas(start_server, tiny_artifacts, round_robin_results) -> ServerProcess:
    return start_replicas(start_server, tiny_artifacts, "cache_aware")


@pytest.fixture(scope="module")
def cache_aware_results(replicas) -> list[dict]:
    return run_workload(replicas.url)


def test_greedy_outputs_are_those_of_one_server(single_results, round_robin_results, cache_aware_results):
    expected = [r["text"] for r in single_results]
    assert [r["text"] for r in cache_aware_results] == expected
    assert [r["text"] for r in round_robin_results] == expected


def test_the_cache_aware_router_reuses_prefixes_round_robin_recomputes(round_robin_results, cache_aware_results):
    assert len({r["replica"] for r in cache_aware_results}) == 2  # both replicas get work
    assert len({r["replica"] for r in round_robin_results}) == 2
    by_topic: dict[str, set] = {}
    for prompt, result in zip(workload(), cache_aware_results):
        by_topic.setdefault(prompt.split(" about ")[1].split(".")[0], set()).add(result["replica"])
    assert all(len(replicas) == 1 for replicas in by_topic.values()), by_topic  # one prefix, one replica
    # Each prefix is prefilled once (its first request), every follow-up reuses it.
    assert hit_rate(cache_aware_results) > 0.7
    assert hit_rate(cache_aware_results) > hit_rate(round_robin_results) + 0.1
    assert prefill_tokens(cache_aware_results) < prefill_tokens(round_robin_results)


def _same_error(single: ServerProcess, replicas: ServerProcess, path: str, headers: dict, body: dict) -> None:
    ours, theirs = (httpx.post(s.url + path, headers=headers, json=body, timeout=30) for s in (replicas, single))
    assert ours.status_code == theirs.status_code and ours.status_code in (400, 401, 404)
    assert ours.json() == theirs.json()


def test_errors_and_auth_are_the_single_servers(single, replicas):
    _same_error(single, replicas, "/v1/completions", AUTH, {"prompt": "hi", "max_tokens": -1})
    _same_error(single, replicas, "/v1/completions", {}, {"prompt": "hi"})
    _same_error(single, replicas, "/v1/completions", AUTH, {"prompt": "hi", "model": "nope"})
    _same_error(single, replicas, "/generate", AUTH, {"sampling_params": {"max_completion_tokens": 4}})
    assert httpx.get(replicas.url + "/health", timeout=10).status_code == 200
    models = httpx.get(replicas.url + "/v1/models", headers=AUTH, timeout=10).json()
    assert models["data"][0]["id"] == "tiny"


def _stream_text(url: str, body: dict) -> str:
    text = ""
    with httpx.stream("POST", url + "/v1/chat/completions", headers=AUTH, json=body, timeout=60) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    text += choice["delta"].get("content") or ""
    return text


def test_streaming_and_priorities_pass_through(single, replicas):
    body = {"messages": [{"role": "user", "content": "Tell me about tokens."}], "max_tokens": 12,
            "temperature": 0, "stream": True, "priority": 3}
    assert _stream_text(replicas.url, body) == _stream_text(single.url, body)


def _replica_figures(server: ServerProcess) -> dict[str, dict[str, float]]:
    figures: dict[str, dict[str, float]] = {}
    for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("kiln_replica_"):
            sample, value = line.rsplit(" ", 1)
            name, replica = sample[len("kiln_replica_"):].split('{replica="')
            figures.setdefault(replica.rstrip('"}'), {})[name] = float(value)
    return figures


def _settled_figures(server: ServerProcess) -> dict[str, dict[str, float]]:
    """The replicas' figures once nothing runs and two of Ray's polls (each second) agree."""
    previous, deadline = None, time.monotonic() + 30
    while time.monotonic() < deadline:
        figures = _replica_figures(server)
        if figures == previous and all(f["running"] == 0 for f in figures.values()):
            return figures
        previous = figures
        time.sleep(1.2)
    raise AssertionError(f"the replicas did not settle: {previous}")


def test_a_client_that_leaves_mid_stream_aborts_and_returns_every_page(replicas):
    before = sum(f["generated_tokens"] for f in _settled_figures(replicas).values())
    body = {"prompt": "Once upon a time", "max_tokens": 240, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", replicas.url + "/v1/completions", headers=AUTH, json=body, timeout=60) as reply:
        lines = reply.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    figures = _settled_figures(replicas)
    assert sum(f["generated_tokens"] for f in figures.values()) - before < 240  # cut short
    for f in figures.values():
        assert f["pages_free"] + f["pages_cached"] == f["pages_total"], figures


def test_the_front_counts_what_it_routed(replicas, cache_aware_results):
    text = httpx.get(replicas.url + "/metrics", timeout=10).text
    routed = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("kiln_dp_requests_routed_total{")]
    assert len(routed) == 2 and sum(routed) >= len(cache_aware_results)
    assert "kiln_dp_prompt_pages_matched_total" in text


def _socket_texts(server: ServerProcess, **options) -> dict[str, str]:
    """Two generations at once on one socket, and one cancelled: each id's text."""
    from websockets.sync.client import connect

    texts = {"a": "", "b": ""}
    url = server.url.replace("http://", "ws://") + "/ws"
    with connect(url, proxy=None, **options) as socket:
        for name, prompt in (("a", "Once upon a time"), ("b", "Models read text")):
            socket.send(json.dumps({"type": "generate", "id": name, "prompt": prompt, "max_tokens": 8,
                                    "temperature": 0, "ignore_eos": True}))
        socket.send(json.dumps({"type": "generate", "id": "c", "prompt": "hi", "max_tokens": 200,
                                "ignore_eos": True}))
        socket.send(json.dumps({"type": "cancel", "id": "c"}))
        done = set()
        while done != {"a", "b", "c"}:
            message = json.loads(socket.recv(timeout=60))
            if message["type"] == "token" and message["id"] in texts:
                texts[message["id"]] += message["text"]
            elif message["type"] == "done":
                done.add(message["id"])
            assert message["type"] != "error", message
    return texts


def test_websocket_sessions_pass_through(single, replicas):
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    headers = {"additional_headers": AUTH}
    assert _socket_texts(replicas, **headers) == _socket_texts(single, **headers)
    with pytest.raises(InvalidStatus):  # refused at the handshake, as a single server refuses it
        connect(replicas.url.replace("http://", "ws://") + "/ws", proxy=None)


GREEDY = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
GRPC_KEY = (("authorization", f"Bearer {KEY}"),)


def test_grpc_through_the_front_answers_as_one_server(single, replicas):
    import grpc
    import tritonclient.grpc as triton
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from smg_grpc_proto.generated import vllm_engine_pb2 as vllm
    from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_grpc
    from tritonclient.utils import InferenceServerException

    from tests.server.test_grpc import triton_inputs

    prompt = _prefix("rivers") + "Question 0 about rivers:"
    want = httpx.post(single.url + "/v1/completions", headers=AUTH, timeout=60,
                      json={"prompt": prompt, **GREEDY}).json()["choices"][0]["text"]
    client = triton.InferenceServerClient(replicas.grpc)
    headers = dict(GRPC_KEY)
    assert client.is_server_ready(headers=headers) and client.is_model_ready("tiny", headers=headers)
    result = client.infer("tiny", triton_inputs(prompt, False, GREEDY), headers=headers)
    assert result.as_numpy("text_output")[0].decode() == want
    pieces, finals, errors = [], [], []

    def callback(result, error):
        if error is not None:
            errors.append(error)
        else:
            pieces.append(result.as_numpy("text_output")[0].decode())
            finals.append(result.get_response().parameters["triton_final_response"].bool_param)

    client.start_stream(callback=callback, headers=headers)
    for n in range(3):  # three requests on one stream, each routed on its own
        client.async_stream_infer("tiny", triton_inputs(prompt, n == 0, GREEDY), request_id=f"s{n}")
    deadline = time.monotonic() + 60
    while sum(finals) < 3 and not errors and time.monotonic() < deadline:
        time.sleep(0.02)
    client.stop_stream()
    assert not errors and sum(finals) == 3 and want in pieces
    with pytest.raises(InferenceServerException) as caught:
        client.infer("tiny", triton_inputs(prompt, False, {"max_tokens": -3}), headers=headers)
    assert "INVALID_ARGUMENT" in str(caught.value.status())
    with pytest.raises(InferenceServerException) as caught:
        client.infer("tiny", triton_inputs(prompt, False, GREEDY))
    assert "UNAUTHENTICATED" in str(caught.value.status())
    client.close()

    ids = httpx.post(single.url + "/tokenize", headers=AUTH, json={"prompt": prompt}, timeout=30).json()["tokens"]
    want_ids = httpx.post(single.url + "/generate", headers=AUTH, timeout=60, json={
        "input_ids": ids, "return_input_ids": True,
        "sampling_params": {"max_completion_tokens": 12, "ignore_eos": True}}).json()
    with grpc.insecure_channel(replicas.grpc) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
        engine = vllm_grpc.VllmEngineStub(channel)
        request = vllm.GenerateRequest(request_id="g1", tokenized=vllm.TokenizedInput(input_ids=ids), stream=True,
                                       sampling_params=vllm.SamplingParams(temperature=0, max_tokens=12,
                                                                           ignore_eos=True))
        streamed = [t for r in engine.Generate(request, timeout=60, metadata=GRPC_KEY)
                    if r.WhichOneof("response") == "chunk" for t in r.chunk.token_ids]
        assert streamed == want_ids
        # An Abort by id reaches the replica running that Generate.
        long = vllm.SamplingParams(temperature=0, max_tokens=70, ignore_eos=True)
        running = engine.Generate(vllm.GenerateRequest(request_id="a1", tokenized=vllm.TokenizedInput(input_ids=ids),
                                                       stream=True, sampling_params=long),
                                  timeout=60, metadata=GRPC_KEY)
        next(iter(running))
        engine.Abort(vllm.AbortRequest(request_ids=["a1"]), metadata=GRPC_KEY)
        assert [r.complete.finish_reason for r in running if r.WhichOneof("response") == "complete"] == ["abort"]
        with pytest.raises(grpc.RpcError) as caught:
            list(engine.Generate(vllm.GenerateRequest(request_id="b1", tokenized=vllm.TokenizedInput(input_ids=[])),
                                 timeout=30, metadata=GRPC_KEY))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # Cancelling mid-stream aborts the generation on its replica.
        call = engine.Generate(vllm.GenerateRequest(request_id="c1", tokenized=vllm.TokenizedInput(input_ids=ids),
                                                    stream=True, sampling_params=long), timeout=60, metadata=GRPC_KEY)
        next(iter(call))
        call.cancel()
    for f in _settled_figures(replicas).values():
        assert f["pages_free"] + f["pages_cached"] == f["pages_total"]


def test_sigterm_drains_the_replicas_and_exits_0(replicas):
    body = {"prompt": "Once upon a time", "max_tokens": 40, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", replicas.url + "/v1/completions", headers=AUTH, json=body, timeout=60) as reply:
        lines = reply.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        replicas.process.terminate()
        rest = list(lines)
    assert [line for line in rest if line][-1] == "data: [DONE]"  # the running request finished
    assert replicas.process.wait(60) == 0, replicas.log()
