"""`kiln serve --grpc-port` on the compiled tiny model: tritonclient (KServe v2 / Triton) and a
VllmEngine client built from the pinned smg-grpc-proto give the tokens the HTTP routes give;
health, reflection, cancellation, API keys and INVALID_ARGUMENT for bad requests."""

from __future__ import annotations

import io
import json
import time
import zipfile

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_grpc
from tritonclient.utils import InferenceServerException

from tests.server_process import free_port

pytestmark = pytest.mark.e2e
PROMPT = "the cat sat on the"
GREEDY = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(start_server, tiny_artifacts, tmp_path_factory):
    port = free_port()
    events = f"ipc://{tmp_path_factory.mktemp('kv-events')}/events"
    process = start_server("--artifacts", tiny_artifacts, "--served-model-name", "tiny", "--grpc-port", str(port),
                           "--kv-events-endpoint", events, "--kv-events-topic", "kv@tiny")
    process.grpc, process.kv_events = f"127.0.0.1:{port}", events
    return process


@pytest.fixture(scope="module")
def engine(server):
    with grpc.insecure_channel(server.grpc) as channel:
        yield vllm_grpc.VllmEngineStub(channel)


def http_completion(server, **fields) -> dict:
    body = {"model": "tiny", "prompt": PROMPT, **GREEDY, **fields}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]


def triton_inputs(prompt: str, stream: bool, sampling: dict, exclude_input: bool = True):
    values = {"text_input": (np.array([prompt.encode()], dtype=object), "BYTES"),
              "stream": (np.array([stream]), "BOOL"),
              "sampling_parameters": (np.array([json.dumps(sampling).encode()], dtype=object), "BYTES"),
              "exclude_input_in_output": (np.array([exclude_input]), "BOOL")}
    inputs = []
    for name, (value, datatype) in values.items():
        tensor = triton.InferInput(name, [1], datatype)
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    return inputs


def test_tritonclient_infer_and_stream_infer_give_the_completions_text(server):
    want = http_completion(server)["text"]
    client = triton.InferenceServerClient(server.grpc)
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("tiny")
    metadata = client.get_model_metadata("tiny", as_json=True)
    assert {i["name"] for i in metadata["inputs"]} >= {"text_input", "stream", "sampling_parameters"}
    result = client.infer("tiny", triton_inputs(PROMPT, False, GREEDY))
    assert result.as_numpy("text_output")[0].decode() == want
    with_prompt = client.infer("tiny", triton_inputs(PROMPT, False, GREEDY, exclude_input=False))
    assert with_prompt.as_numpy("text_output")[0].decode() == PROMPT + want

    pieces, finals, errors = [], [], []

    def callback(result, error):
        if error is not None:
            errors.append(error)
            return
        pieces.append(result.as_numpy("text_output")[0].decode())
        finals.append(result.get_response().parameters["triton_final_response"].bool_param)

    client.start_stream(callback=callback)
    client.async_stream_infer("tiny", triton_inputs(PROMPT, True, GREEDY), request_id="s1")
    deadline = time.monotonic() + 60
    while not any(finals) and not errors and time.monotonic() < deadline:
        time.sleep(0.02)
    client.stop_stream()
    assert not errors and finals[-1] and not any(finals[:-1])
    assert len(pieces) > 1 and "".join(pieces) == want
    # Bad sampling parameters: INVALID_ARGUMENT, never INTERNAL.
    with pytest.raises(InferenceServerException) as caught:
        client.infer("tiny", triton_inputs(PROMPT, False, {"temprature": 0}))
    assert "INVALID_ARGUMENT" in str(caught.value.status()) and "temprature" in caught.value.message()
    with pytest.raises(InferenceServerException) as caught:
        client.infer("tiny", triton_inputs(PROMPT, False, {"max_tokens": -3}))
    assert "INVALID_ARGUMENT" in str(caught.value.status())
    with pytest.raises(InferenceServerException) as caught:
        client.infer("nope", triton_inputs(PROMPT, False, GREEDY))
    assert "NOT_FOUND" in str(caught.value.status())
    client.close()


def test_vllm_engine_generate_streams_the_generate_routes_tokens(server, engine):
    ids = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}, timeout=30).json()["tokens"]
    want = httpx.post(server.url + "/generate", timeout=60, json={
        "input_ids": ids, "return_input_ids": True,
        "sampling_params": {"max_completion_tokens": 12, "ignore_eos": True}}).json()
    request = vllm.GenerateRequest(request_id="g1", tokenized=vllm.TokenizedInput(input_ids=ids), stream=True,
                                   sampling_params=vllm.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    chunks, completes = [], []
    for response in engine.Generate(request, timeout=60):
        (chunks if response.WhichOneof("response") == "chunk" else completes).append(response)
    streamed = [t for r in chunks for t in r.chunk.token_ids]
    assert streamed == want and len(chunks) > 1
    [complete] = completes
    assert list(complete.complete.output_ids) == want and complete.complete.finish_reason == "length"
    assert complete.complete.prompt_tokens == len(ids) and complete.complete.completion_tokens == 12
    # Not streamed: one GenerateComplete per sequence.
    request.stream, request.request_id, request.sampling_params.n = False, "g2", 2
    responses = list(engine.Generate(request, timeout=60))
    assert sorted(r.complete.index for r in responses) == [0, 1]
    assert all(list(r.complete.output_ids) == want for r in responses)


def test_health_reflection_and_information(server, engine):
    with grpc.insecure_channel(server.grpc) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", "inference.GRPCInferenceService", "vllm.grpc.engine.VllmEngine"):
            assert health.Check(health_pb2.HealthCheckRequest(service=name)).status == \
                health_pb2.HealthCheckResponse.SERVING
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        [answer] = reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for s in answer.list_services_response.service}
        assert {"inference.GRPCInferenceService", "vllm.grpc.engine.VllmEngine", "grpc.health.v1.Health"} <= names
    assert engine.HealthCheck(vllm.HealthCheckRequest()).healthy
    info = engine.GetModelInfo(vllm.GetModelInfoRequest())
    assert info.served_model_name == "tiny" and info.max_context_length == 256 and info.is_generation
    loads = engine.GetLoads(vllm.GetLoadsRequest()).loads[0]
    assert loads.max_total_num_tokens > 0 and loads.num_running_reqs == 0
    assert engine.GetServerInfo(vllm.GetServerInfoRequest()).server_type == "kiln-grpc"
    data, digest = b"", ""
    for chunk in engine.GetTokenizer(common_pb2.GetTokenizerRequest()):
        data, digest = data + chunk.data, chunk.sha256 or digest
    import hashlib

    assert hashlib.sha256(data).hexdigest() == digest
    assert "tokenizer.json" in zipfile.ZipFile(io.BytesIO(data)).namelist()
    with pytest.raises(grpc.RpcError) as caught:
        engine.Embed(vllm.EmbedRequest(request_id="e"))
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED and "embeddings" in caught.value.details()


def test_cancelling_mid_stream_returns_every_page_and_bad_requests_are_invalid(server, engine):
    long = vllm.SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    call = engine.Generate(vllm.GenerateRequest(request_id="c1", tokenized=vllm.TokenizedInput(input_ids=[5, 6, 7]),
                                                stream=True, sampling_params=long), timeout=60)
    seen = 0
    for _ in call:
        seen += 1
        if seen == 2:
            call.cancel()
            break
    assert server.wait_metric("kiln_kv_pages_active", 0) == 0
    assert server.wait_metric("kiln_sequences_running", 0) == 0
    # Abort by id, from another call.
    running = engine.Generate(vllm.GenerateRequest(request_id="a1", tokenized=vllm.TokenizedInput(input_ids=[9, 8]),
                                                   stream=True, sampling_params=long), timeout=60)
    next(iter(running))
    engine.Abort(vllm.AbortRequest(request_ids=["a1"]))
    assert [r.complete.finish_reason for r in running if r.WhichOneof("response") == "complete"] == ["abort"]
    for bad in (vllm.GenerateRequest(request_id="b1", tokenized=vllm.TokenizedInput(input_ids=[10**6])),
                vllm.GenerateRequest(request_id="b2", tokenized=vllm.TokenizedInput(input_ids=[5]),
                                     sampling_params=vllm.SamplingParams(json_schema="{not json", max_tokens=4)),
                vllm.GenerateRequest(request_id="b3", tokenized=vllm.TokenizedInput(input_ids=[])),
                vllm.GenerateRequest(request_id="b4", tokenized=vllm.TokenizedInput(input_ids=[5]),
                                     sampling_params=vllm.SamplingParams(top_p=3.0, max_tokens=4))):
        with pytest.raises(grpc.RpcError) as caught:
            list(engine.Generate(bad, timeout=30))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()


def test_api_keys_guard_grpc_as_they_guard_http(start_server, tiny_artifacts):
    port = free_port()
    start_server("--artifacts", tiny_artifacts, "--grpc-port", str(port), "--api-key", "sesame")
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        engine = vllm_grpc.VllmEngineStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            engine.HealthCheck(vllm.HealthCheckRequest())
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert engine.HealthCheck(vllm.HealthCheckRequest(), metadata=[("authorization", "Bearer sesame")]).healthy
        health = health_pb2_grpc.HealthStub(channel)  # open, for load balancers
        assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
    client = triton.InferenceServerClient(f"127.0.0.1:{port}")
    with pytest.raises(InferenceServerException):
        client.is_server_live()
    assert client.is_server_live(headers={"authorization": "Bearer sesame"})


def test_kv_events_over_zmq_and_grpc_describe_the_pages_a_prompt_left(server, engine):
    import msgpack
    import zmq

    subscriber = zmq.Context.instance().socket(zmq.SUB)
    subscriber.connect(server.kv_events)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"kv@tiny")
    time.sleep(0.3)  # a SUB socket sees only what is sent once it has joined
    stream = engine.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(start_sequence_number=1), timeout=60)
    load = next(stream)  # a load record first, at once: gateways take a silent stream for a dead worker
    assert load.load.load_only and not load.events and load.sequence_number == 0
    assert load.load.max_running_requests == 32 and load.load.running_requests == 0
    first = next(stream)
    assert first.sequence_number == 1 and first.events[0].WhichOneof("data") == "cleared"
    assert not first.load.load_only
    prompt = [(7 * i) % 300 + 4 for i in range(40)]  # two full pages of 16, and 8 tokens more
    body = {"input_ids": prompt, "sampling_params": {"max_completion_tokens": 2}}
    assert httpx.post(server.url + "/generate", json=body, timeout=60).status_code == 200

    stored = []
    subscriber.setsockopt(zmq.RCVTIMEO, 10_000)
    while len(stored) < 2:
        topic, number, payload = subscriber.recv_multipart()
        assert topic == b"kv@tiny" and int.from_bytes(number, "big") > 1
        timestamp, events = msgpack.unpackb(payload)
        stored += [e for e in events if e[0] == "BlockStored"]
    (_, [first_hash], parent, tokens, size, _, medium), (_, [second_hash], second_parent, second_tokens, *_) = stored[:2]
    assert parent is None and tokens == prompt[:16] and size == 16 and medium == "GPU"
    assert second_parent == first_hash and second_tokens == prompt[16:32]
    subscriber.close(0)

    by_hash = {}  # the history replays earlier tests' pages too: find this prompt's by hash
    for batch in stream:
        for event in batch.events:
            if event.WhichOneof("data") == "stored":
                by_hash[event.stored.blocks[0].block_hash] = event.stored
        if first_hash in by_hash and second_hash in by_hash:
            break
    stream.cancel()
    first_page, second_page = by_hash[first_hash], by_hash[second_hash]
    assert list(first_page.blocks[0].token_ids) == prompt[:16] and not first_page.HasField("parent_block_hash")
    assert list(second_page.blocks[0].token_ids) == prompt[16:32] and second_page.parent_block_hash == first_hash
