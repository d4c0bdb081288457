"""Every front door, HTTP and gRPC, over one fake-program server: the same request check (the
same error naming the same field), the same metrics, and a clear error, never a 5xx, UNKNOWN or
INTERNAL, for any value of any field (property-based over the gRPC services' fields)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_grpc
from tritonclient.grpc import service_pb2 as kserve
from tritonclient.grpc import service_pb2_grpc as kserve_grpc
from tritonclient.utils import InferenceServerException
from websockets.sync.client import connect

from tests.fake_program import expected_greedy
from tests.server_process import free_port, wait_until_answers

MAX_N = 4
PROMPT_IDS = [5, 9, 13, 40]
# A request each door refuses, and the words its error must hold.
INVALID = {"n": ({"n": 100}, f"n must be in [1, {MAX_N}], got 100"),
           "max_tokens": ({"max_tokens": 0}, "max_tokens must be >= 1, got 0")}
CLEAN_GRPC_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED,
                    grpc.StatusCode.UNAVAILABLE}


class Doors:
    """One server's HTTP and gRPC addresses, and a request through each door."""

    def __init__(self, port: int, grpc_port: int, service):
        self.url, self.port, self.service = f"http://127.0.0.1:{port}", port, service
        self.channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
        self.engine = vllm_grpc.VllmEngineStub(self.channel)
        self.kserve = kserve_grpc.GRPCInferenceServiceStub(self.channel)
        self.triton = triton.InferenceServerClient(f"127.0.0.1:{grpc_port}")

    # Each returns (message, field) of the error, or None when the request succeeds.
    def completions(self, fields: dict):
        return _http_error(httpx.post(self.url + "/v1/completions", json={"prompt": PROMPT_IDS, **fields}, timeout=30))

    def chat(self, fields: dict):
        body = {"messages": [{"role": "user", "content": "hi"}], **fields}
        return _http_error(httpx.post(self.url + "/v1/chat/completions", json=body, timeout=30))

    def generate(self, fields: dict):
        answer = httpx.post(self.url + "/generate", json={"input_ids": PROMPT_IDS, "sampling_params": {
            {"max_tokens": "max_completion_tokens"}.get(name, name): value for name, value in fields.items()}},
            timeout=30)
        return (answer.json()["error"], None) if answer.status_code >= 400 else None

    def websocket(self, fields: dict):
        with connect(f"ws://127.0.0.1:{self.port}/ws") as socket:
            socket.send(json.dumps({"type": "generate", "id": "a", "input_ids": PROMPT_IDS, **fields}))
            while (message := json.loads(socket.recv(timeout=30)))["type"] == "token":
                pass
        return (message["error"]["message"], message["error"]["param"]) if message["type"] == "error" else None

    def kserve_infer(self, fields: dict):
        try:
            self.triton.infer("fake", kserve_inputs(json.dumps(fields).encode()))
        except InferenceServerException as error:
            assert error.status() == "StatusCode.INVALID_ARGUMENT", error
            return error.message(), None
        return None

    def vllm_generate(self, fields: dict):
        request = vllm.GenerateRequest(request_id="x", tokenized=vllm.TokenizedInput(input_ids=PROMPT_IDS),
                                       sampling_params=vllm.SamplingParams(**fields))
        try:
            list(self.engine.Generate(request, timeout=30))
        except grpc.RpcError as error:
            assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, error
            return error.details(), None
        return None


def _http_error(answer: httpx.Response):
    if answer.status_code < 400:
        return None
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    return error["message"], error["param"]


def kserve_inputs(sampling: bytes, text: bytes = b"the cat") -> list:
    inputs = []
    for name, value, datatype in (("text_input", np.array([text], dtype=object), "BYTES"),
                                  ("sampling_parameters", np.array([sampling], dtype=object), "BYTES")):
        tensor = triton.InferInput(name, [1], datatype)
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    return inputs


@pytest.fixture(scope="module")
def doors(start_fake_server):
    grpc_port = free_port()
    port, service = start_fake_server(max_n=MAX_N, grpc_port=grpc_port)
    doors = Doors(port, grpc_port, service)
    yield doors
    doors.channel.close()


DOORS = ("completions", "chat", "generate", "websocket", "kserve_infer", "vllm_generate")


@pytest.mark.parametrize("field", sorted(INVALID))
@pytest.mark.parametrize("door", DOORS)
def test_the_same_invalid_request_gets_the_same_error_at_every_door(doors, door, field):
    fields, words = INVALID[field]
    error = getattr(doors, door)({"temperature": 0, **fields})
    assert error is not None, f"{door} took {fields}"
    message, param = error
    assert words in message
    assert param in (field, None)  # gRPC and shortfin errors carry a message only


def test_metrics_count_grpc_calls_and_their_generations(doors):
    def metric(name: str) -> float:
        for line in httpx.get(doors.url + "/metrics").text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                labels = line[len(name):].rpartition(" ")[0]
                if all(part in labels for part in wanted[name]):
                    return float(line.rpartition(" ")[2])
        return 0.0

    wanted = {"kiln_grpc_requests_total": ('method="/vllm.grpc.engine.VllmEngine/Generate"', 'code="OK"'),
              "kiln_sequences_finished_total": ('reason="length"',),
              "kiln_request_prompt_tokens_count": ()}
    before = {name: metric(name) for name in wanted}
    request = vllm.GenerateRequest(request_id="counted", tokenized=vllm.TokenizedInput(input_ids=PROMPT_IDS),
                                   sampling_params=vllm.SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    [complete] = [r.complete for r in doors.engine.Generate(request, timeout=30)]
    assert list(complete.output_ids) == expected_greedy(PROMPT_IDS, 3)
    after = {name: metric(name) for name in wanted}
    assert all(after[name] == before[name] + 1 for name in wanted), (before, after)
    doors.vllm_generate({"n": 100})
    wanted["kiln_grpc_requests_total"] = ('method="/vllm.grpc.engine.VllmEngine/Generate"', 'code="INVALID_ARGUMENT"')
    assert metric("kiln_grpc_requests_total") >= 1


def test_a_grpc_text_is_refused_by_size_before_it_is_tokenized(doors):
    too_long = vllm.GenerateRequest(request_id="long", text="x" * (2**20 + 1), sampling_params=vllm.SamplingParams())
    with pytest.raises(grpc.RpcError) as error:
        list(doors.engine.Generate(too_long, timeout=30))
    assert error.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "characters" in error.value.details()


def _deep(levels: int) -> str:
    """A JSON list nested `levels` deep, as text (too deep for json.dumps to write)."""
    return "[" * levels + "]" * levels


@pytest.mark.parametrize("sampling", [
    '{"stop": 5}', '{"stop_token_ids": 7}', '{"temperature": {"a": 1}}', '{"n": [1]}', '{"seed": "x"}',
    '{"logit_bias": [1]}', '{"stop": %s}' % _deep(500), '{"stop": %s}' % _deep(5000), _deep(100_000),
    '{"best_of": 1000, "use_beam_search": true}', '{"pooling": "mean"}', '{"pooling": {"mode": "last"}}',
    '{"lora": "sql"}',
])
def test_kserve_sampling_parameters_of_the_wrong_type_or_depth_are_invalid_argument(doors, sampling):
    with pytest.raises(InferenceServerException) as error:
        doors.triton.infer("fake", kserve_inputs(sampling.encode()))
    assert error.value.status() == "StatusCode.INVALID_ARGUMENT", error.value.message()


@pytest.mark.parametrize("structured", ['{"choice": "yes or no"}', '{"choice": %s}' % _deep(500),
                                        '{"json": %s}' % _deep(500), '{"choice": %s}' % _deep(5000),
                                        '{"regex": 5}', '{"json": 5}'])
def test_structured_outputs_of_the_wrong_type_or_depth_are_400s(doors, structured):
    body = '{"prompt": "hi", "structured_outputs": %s}' % structured
    answer = httpx.post(doors.url + "/v1/completions", content=body, timeout=30,
                        headers={"content-type": "application/json"})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] in ("structured_outputs", None)


UNSATISFIABLE = [
    {"$ref": "#"},
    {"type": "object", "properties": {"child": {"$ref": "#"}}, "required": ["child"]},
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
]


@pytest.mark.parametrize("schema", UNSATISFIABLE)
def test_a_schema_no_finite_value_satisfies_is_a_400_at_every_structured_door(doors, schema):
    answers = {
        "response_format": httpx.post(doors.url + "/v1/chat/completions", timeout=30, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}),
        "guided_json": httpx.post(doors.url + "/v1/completions", json={"prompt": "hi", "guided_json": schema},
                                  timeout=30),
        "tools": httpx.post(doors.url + "/v1/chat/completions", timeout=30, json={
            "messages": [{"role": "user", "content": "hi"}], "tool_choice": "required",
            "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}]}),
        "json_schema": httpx.post(doors.url + "/generate", timeout=30, json={
            "input_ids": PROMPT_IDS, "sampling_params": {"json_schema": json.dumps(schema)}}),
    }
    for param, answer in answers.items():
        assert answer.status_code == 400, (param, answer.text)
        if param != "json_schema":  # shortfin's errors carry a message only
            assert answer.json()["error"]["param"] == param
    request = vllm.GenerateRequest(request_id="u", tokenized=vllm.TokenizedInput(input_ids=PROMPT_IDS),
                                   sampling_params=vllm.SamplingParams(json_schema=json.dumps(schema)))
    with pytest.raises(grpc.RpcError) as error:
        list(doors.engine.Generate(request, timeout=30))
    assert error.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "json_schema" in error.value.details()


# -- property-based: any value of any field is an answer or a clean refusal --------------------
JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                        max_size=3), max_leaves=8)
SAMPLING_NAMES = ["max_tokens", "temperature", "top_k", "top_p", "min_p", "n", "stop", "stop_token_ids", "seed",
                  "ignore_eos", "logprobs", "prompt_logprobs", "min_tokens", "logit_bias", "repetition_penalty",
                  "presence_penalty", "frequency_penalty", "skip_special_tokens", "num_beams", "length_penalty",
                  "speculative", "best_of", "use_beam_search", "guided_json", "constraint", "diffusion", "pooling",
                  "lora"]
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(st.dictionaries(st.sampled_from(SAMPLING_NAMES), JSON_VALUES | st.text(max_size=4), max_size=4))
def test_kserve_any_sampling_parameters_get_an_answer_or_invalid_argument(doors, fields):
    fields.setdefault("max_tokens", 2)
    if isinstance(fields["max_tokens"], int) and fields["max_tokens"] > 4:
        fields["max_tokens"] = 4  # the fuzz is about the fields' values, not about long generations
    request = kserve.ModelInferRequest(model_name="fake", raw_input_contents=[], inputs=[])
    for tensor in kserve_inputs(json.dumps(fields, allow_nan=True).encode()):
        request.inputs.append(tensor._get_tensor())
    try:
        doors.kserve.ModelInfer(request, timeout=30)
    except grpc.RpcError as error:
        assert error.code() in CLEAN_GRPC_CODES, (fields, error.code(), error.details())


UINT = st.integers(0, 2**32 - 1)
VLLM_SAMPLING = st.fixed_dictionaries({}, optional={
    "temperature": st.floats(width=32), "top_p": st.floats(width=32), "top_k": UINT,
    "min_p": st.floats(width=32), "frequency_penalty": st.floats(width=32),
    "presence_penalty": st.floats(width=32), "repetition_penalty": st.floats(width=32),
    "max_tokens": st.integers(0, 6), "min_tokens": st.integers(0, 8), "stop": st.lists(st.text(max_size=5), max_size=3),
    "stop_token_ids": st.lists(UINT, max_size=3), "ignore_eos": st.booleans(), "n": st.integers(0, 2**32 - 1),
    "logprobs": st.integers(-2**31, 2**31 - 1), "prompt_logprobs": st.integers(-2**31, 2**31 - 1),
    "seed": st.integers(-2**31, 2**31 - 1), "logit_bias": st.dictionaries(st.integers(-2**31, 2**31 - 1),
                                                                         st.floats(width=32), max_size=3),
    "json_schema": st.text(max_size=30), "regex": st.text(max_size=10), "grammar": st.text(max_size=10),
    "json_object": st.booleans(),
})


@FUZZ
@given(VLLM_SAMPLING, st.one_of(st.lists(st.integers(0, 2**32 - 1), max_size=6), st.text(max_size=20)))
def test_vllm_engine_any_request_gets_an_answer_or_invalid_argument(doors, sampling, prompt):
    constraints = [name for name in ("json_schema", "regex", "grammar", "json_object") if name in sampling]
    for name in constraints[1:]:  # a oneof: the proto keeps only the last set
        del sampling[name]
    inputs = {"text": prompt} if isinstance(prompt, str) else {"tokenized": vllm.TokenizedInput(input_ids=prompt)}
    request = vllm.GenerateRequest(request_id="", sampling_params=vllm.SamplingParams(**sampling), **inputs)
    try:
        list(doors.engine.Generate(request, timeout=30))
    except grpc.RpcError as error:
        assert error.code() in CLEAN_GRPC_CODES, (sampling, prompt, error.code(), error.details())


@pytest.fixture
def server_of_its_own(fake_model_dir):
    """A server in a process of its own: /health's latency is then the server's, not that of this
    process's other threads (the session's in-process servers, the client encoding a 1 MB body)."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "tests.fake_server", str(fake_model_dir), str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_answers(url + "/health", process, timeout=60)
        yield url
    finally:
        process.kill()
        process.wait()


def test_health_answers_while_a_50000_way_choice_compiles(server_of_its_own):
    """The grammar compiles on a worker thread: /health keeps answering at once meanwhile, and the
    request itself is answered with one of the choices."""
    choices = [f"option {i} of many" for i in range(50_000)]
    body = json.dumps({"prompt": "pick", "guided_choice": choices, "max_tokens": 40, "temperature": 0, "n": 2})
    answer: dict = {}

    def ask():
        answer["response"] = httpx.post(server_of_its_own + "/v1/completions", timeout=120, content=body,
                                        headers={"content-type": "application/json"})

    asking = threading.Thread(target=ask)
    latencies = []
    with httpx.Client(base_url=server_of_its_own, timeout=30) as client:
        client.get("/health")
        asking.start()
        while asking.is_alive():
            started = time.monotonic()
            assert client.get("/health").status_code == 200
            latencies.append(time.monotonic() - started)
            time.sleep(0.01)
    response = answer["response"]
    assert response.status_code == 200, response.text
    answered = response.json()["choices"]
    assert all(choice["text"] in choices and choice["finish_reason"] == "stop" for choice in answered), answered
    assert len(latencies) > 5  # the compile took a while, and /health was asked all along
    # Blocked by the compile, /health would wait for all of it; a garbage-collection pause in a
    # large test process has taken a tenth of a second on its own.
    assert max(latencies) < 0.5, sorted(latencies)[-5:]


def test_every_openai_shaped_door_fills_unset_sampling_fields_with_the_models_defaults(doors, monkeypatch):
    """The model's generation defaults (its generation_config.json) stand in for each sampling
    field a request leaves unset, at every door that speaks OpenAI's or vLLM's fields; a field the
    request sets is its own; /generate keeps shortfin's defaults (greedy unless sampled)."""
    monkeypatch.setattr(doors.service, "generation_defaults", {"temperature": 0.25, "top_k": 7, "top_p": 0.5})
    submitted = []
    submit = doors.service.submit
    monkeypatch.setattr(doors.service, "submit",
                        lambda ids, params, *args: submitted.append(params) or submit(ids, params, *args))
    fields = {"max_tokens": 2, "top_p": 0.75}
    for door in ("completions", "chat", "websocket", "kserve_infer", "vllm_generate"):
        submitted.clear()
        assert getattr(doors, door)(fields) is None
        assert [(p.temperature, p.top_k, p.top_p) for p in submitted] == [(0.25, 7, 0.75)], door
    answer = httpx.post(doors.url + "/v1/responses", json={"input": "hi", "max_output_tokens": 2}, timeout=30)
    assert answer.status_code == 200, answer.text
    assert (submitted[-1].temperature, submitted[-1].top_k, submitted[-1].top_p) == (0.25, 7, 0.5)
    submitted.clear()
    assert doors.generate({"max_tokens": 2}) is None
    assert submitted[0].temperature == 0.0 and submitted[0].top_k == -1
