"""benchmarks.loadgen without a model: the metric math on made-up timelines, the SSE parser on
awkwardly split bytes, and whole runs against a fake streaming server on 127.0.0.1.

No assertion here depends on how fast anything ran."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest
import uvicorn
from tokenizers import Tokenizer, models, pre_tokenizers

from benchmarks import guidellm_runner, loadgen
from benchmarks.loadgen import RequestResult, SSEParser, summarize


def result(ttft: float, gaps: list[float], tokens: int, start: float = 0.0, prompt_len: int = 10,
           **kw) -> RequestResult:
    r = RequestResult(prompt_len=prompt_len, start=start, ttft=ttft, itl=list(gaps),
                      latency=ttft + sum(gaps), output_tokens=tokens, **kw)
    return r


# -- metric math --------------------------------------------------------------------------------

def test_summarize_follows_vllm_definitions():
    a = result(0.100, [0.010, 0.030], tokens=3)  # e2e 0.140, tpot (0.140-0.100)/2 = 0.020
    b = result(0.300, [0.020] * 4, tokens=5)  # e2e 0.380, tpot 0.080/4 = 0.020
    m = summarize([a, b], duration_s=2.0, backend="openai", workload="random", concurrency=2)
    assert set(m) == set(loadgen.METRIC_KEYS)
    assert (m["completed"], m["failed"], m["num_requests"]) == (2, 0, 2)
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["p50_ttft_ms"] == pytest.approx(200.0)
    assert m["p90_ttft_ms"] == pytest.approx(280.0)  # linear interpolation between 100 and 300
    assert m["mean_tpot_ms"] == pytest.approx(20.0)
    assert m["mean_e2el_ms"] == pytest.approx(260.0)
    # ITL pools every gap of every request: 10, 30, 20, 20, 20, 20.
    assert m["mean_itl_ms"] == pytest.approx(20.0)
    assert m["p50_itl_ms"] == pytest.approx(20.0)
    assert m["p99_itl_ms"] == pytest.approx(29.5)
    assert m["total_input_tokens"] == 20 and m["total_output_tokens"] == 8
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(4.0)
    assert m["total_token_throughput"] == pytest.approx(14.0)
    assert m["ttft_is_e2e"] is False and m["errors"] == []
    assert m["max_concurrency"] == 2 and m["request_rate"] is None


def test_failures_are_counted_not_averaged():
    ok = result(0.5, [0.1], tokens=2)
    bad = RequestResult(prompt_len=10, error="HTTP 503: queue full")
    m = summarize([ok, bad, RequestResult(error="HTTP 503: queue full")], duration_s=1.0)
    assert (m["completed"], m["failed"]) == (1, 2)
    assert m["errors"] == ["HTTP 503: queue full"]
    assert m["mean_ttft_ms"] == pytest.approx(500.0)
    assert m["total_input_tokens"] == 10


def test_one_token_outputs_have_no_tpot():
    m = summarize([result(0.2, [], tokens=1)], duration_s=1.0)
    assert m["mean_tpot_ms"] is None and m["mean_itl_ms"] is None
    assert m["mean_e2el_ms"] == pytest.approx(200.0)


def test_non_streamed_answers_flag_ttft_as_e2e():
    r = RequestResult(prompt_len=4, output_tokens=16)
    body = {"responses": [{"prompt": "p", "responses": [{"text": "xyz"}]}]}
    loadgen.ShortfinBackend.on_body(r, now=10.5, t0=10.0, body=json.dumps(body).encode())
    assert r.ok and r.ttft_is_e2e and r.ttft == r.latency == pytest.approx(0.5)
    m = summarize([r], duration_s=1.0)
    assert m["ttft_is_e2e"] is True
    assert m["mean_ttft_ms"] == m["mean_e2el_ms"] == pytest.approx(500.0)
    assert m["mean_tpot_ms"] is None and m["mean_itl_ms"] is None


def test_empty_run():
    m = summarize([], duration_s=0.0)
    assert m["completed"] == 0 and m["request_throughput"] == 0.0 and m["p99_e2el_ms"] is None


def test_chunks_without_text_are_not_tokens():
    r = RequestResult()
    r.chunk(1.0, "", t0=0.0)
    assert r.ttft is None
    r.chunk(1.5, "a", t0=0.0)
    r.chunk(1.7, "", t0=0.0)
    r.chunk(2.0, "b", t0=0.0)
    assert r.ttft == 1.5 and r.itl == [pytest.approx(0.5)] and r.latency == 2.0 and r.text == "ab"


def test_arrival_offsets():
    assert loadgen.arrival_offsets(3, None) == [0.0, 0.0, 0.0]
    assert loadgen.arrival_offsets(3, float("inf")) == [0.0, 0.0, 0.0]
    a = loadgen.arrival_offsets(2000, 4.0, seed=7)
    assert a == loadgen.arrival_offsets(2000, 4.0, seed=7)
    assert a != loadgen.arrival_offsets(2000, 4.0, seed=8)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:]))
    assert a[-1] / (len(a) - 1) == pytest.approx(0.25, rel=0.1)  # mean gap 1/rate
    with pytest.raises(ValueError):
        loadgen.arrival_offsets(2, 0.0)


# -- SSE ----------------------------------------------------------------------------------------

def feed_all(parser: SSEParser, pieces: list[bytes]) -> list[tuple[str, str]]:
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    return events + parser.close()


def test_sse_split_anywhere():
    stream = ('data: {"choices":[{"text":"héllo"}]}\r\n\r\n'
              ": keep-alive\n\n"
              "event: note\ndata: line one\ndata: line two\n\n"
              'error: {"message":"boom"}\n\n'
              "data: [DONE]\n\n").encode()
    expected = [("message", '{"choices":[{"text":"héllo"}]}'), ("note", "line one\nline two"),
                ("error", '{"message":"boom"}'), ("message", "[DONE]")]
    assert feed_all(SSEParser(), [stream]) == expected
    # Byte by byte splits "é" between two chunks.
    assert feed_all(SSEParser(), [stream[i:i + 1] for i in range(len(stream))]) == expected


def test_sse_last_event_without_blank_line():
    assert feed_all(SSEParser(), [b"data: a\n\ndata: b"]) == [("message", "a"), ("message", "b")]


def test_openai_events():
    r = RequestResult()
    on = loadgen.OpenAIBackend.on_event
    on(r, 1.0, 0.0, "message", '{"choices":[{"text":"x"}]}')
    on(r, 1.1, 0.0, "message", '{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":9}}')
    on(r, 1.2, 0.0, "message", "[DONE]")
    assert r.ok and r.output_tokens == 9 and r.text == "x"
    bad = RequestResult()
    on(bad, 1.0, 0.0, "message", '{"error":{"message":"aborted","type":"server_error"}}')
    assert bad.error == "aborted" and not bad.ok


def test_chat_and_anthropic_events():
    chat = RequestResult()
    on = loadgen.ChatBackend.on_event
    on(chat, 1.0, 0.0, "message", '{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}')
    on(chat, 1.1, 0.0, "message", '{"choices":[{"index":0,"delta":{"content":"hi"}}]}')
    on(chat, 1.2, 0.0, "message", '{"choices":[],"usage":{"completion_tokens":2}}')
    assert chat.ok and chat.text == "hi" and chat.output_tokens == 2 and chat.ttft == pytest.approx(1.1)
    message = RequestResult()
    on = loadgen.AnthropicBackend.on_event
    text_delta = {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": ""}}
    events = [{"type": "message_start", "message": {"content": []}}, {"type": "ping"},
              {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
              {**text_delta, "delta": {"type": "text_delta", "text": "he"}},
              {**text_delta, "delta": {"type": "text_delta", "text": "y"}},
              {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 3}}]
    for number, event in enumerate(events):
        on(message, 1.0 + number * 0.1, 0.0, event["type"], json.dumps(event))
    assert message.ok and message.text == "hey" and message.output_tokens == 3
    failed = RequestResult()
    on(failed, 1.0, 0.0, "error", '{"type":"error","error":{"type":"overloaded_error","message":"queue full"}}')
    assert not failed.ok and "queue full" in failed.error


def test_shortfin_events_json_and_plain():
    r = RequestResult()
    on = loadgen.ShortfinBackend.on_event
    on(r, 1.0, 0.0, "message", '{"rid":"a","text":"he","token_ids":[1,2]}')
    on(r, 1.2, 0.0, "message", '{"rid":"a","text":"y","token_ids":[3]}')
    assert r.text == "hey" and r.output_tokens == 3 and r.itl == [pytest.approx(0.2)]
    plain = RequestResult()
    on(plain, 1.0, 0.0, "message", "some text")
    assert plain.text == "some text" and plain.output_tokens is None


# -- against a fake server ----------------------------------------------------------------------

WORDS = [f"w{i}" for i in range(200)]


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory):
    """A word-level tokenizer: 200 words, one token each, so prompt lengths are exact."""
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["[UNK]"])
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


async def _read_json(receive) -> dict:
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            return json.loads(body or b"{}")


async def _json_response(send, status: int, payload) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": json.dumps(payload).encode()})


async def fake_server(scope, receive, send):
    """/v1/models, streamed /v1/completions (events split across writes, usage at the end),
    and a shortfin-3.9-like /generate that ignores `stream` and answers one JSON body."""
    assert scope["type"] == "http"
    request = await _read_json(receive) if scope["method"] == "POST" else {}
    if scope["path"] == "/v1/models":
        return await _json_response(send, 200, {"data": [{"id": "fake"}]})
    if scope["path"] == "/generate":
        n = request["sampling_params"]["max_completion_tokens"]
        await asyncio.sleep(0.01)
        return await _json_response(send, 200, {"responses": [{"prompt": request["text"], "responses": [
            {"text": " ".join(WORDS[:n])}]}]})
    if scope["path"] != "/v1/completions":
        return await _json_response(send, 404, {"error": {"message": "no route"}})
    if request.get("model") != "fake" or not request.get("ignore_eos") or request.get("temperature") != 0:
        return await _json_response(send, 400, {"error": {"message": f"bad request {request}"}})
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream")]})
    for i in range(request["max_tokens"]):
        event = f'data: {json.dumps({"choices": [{"index": 0, "text": " " + WORDS[i]}]})}\n\n'.encode()
        await send({"type": "http.response.body", "body": event[:7], "more_body": True})
        await send({"type": "http.response.body", "body": event[7:], "more_body": True})
        await asyncio.sleep(0.002)
    usage = {"prompt_tokens": 1, "completion_tokens": request["max_tokens"], "total_tokens": 0}
    await send({"type": "http.response.body", "more_body": True,
                "body": f'data: {json.dumps({"choices": [], "usage": usage})}\n\ndata: [DONE]\n\n'.encode()})
    await send({"type": "http.response.body", "body": b""})


@pytest.fixture(scope="module")
def server_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(fake_server, host="127.0.0.1", port=port, lifespan="off",
                                           log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the fake server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def test_workload_prompts_have_exact_lengths(tokenizer_path):
    tok = loadgen.load_tokenizer(tokenizer_path)
    w = loadgen.make_workload("random", tokenizer_path, num_requests=5, input_len=12, output_len=4)
    assert len(w) == 5 and w.output_len == 4
    assert [len(tok.encode(p).ids) for p in w.prompts] == [12] * 5 == w.prompt_lens
    s = loadgen.make_workload("shared_prefix", tokenizer_path, num_requests=4, prefix_len=20, suffix_len=3)
    ids = [tok.encode(p).ids for p in s.prompts]
    assert all(len(i) == 23 for i in ids) and len({tuple(i[:20]) for i in ids}) == 1
    assert len({tuple(i[20:]) for i in ids}) == 4
    assert not s.warmup_prompt.startswith(s.prompts[0][:20])


@pytest.mark.parametrize("rate,concurrency", [(None, 2), (200.0, None), (None, None)])
def test_openai_run_against_fake_server(server_url, tokenizer_path, rate, concurrency):
    w = loadgen.make_workload("random", tokenizer_path, num_requests=6, input_len=8, output_len=5)
    m, results = loadgen.bench("openai", server_url, w, rate=rate, concurrency=concurrency)
    assert (m["completed"], m["failed"]) == (6, 0), m["errors"]
    assert m["total_output_tokens"] == 30 and m["total_input_tokens"] == 48
    assert all(r.text == " w0 w1 w2 w3 w4" and len(r.itl) == 4 for r in results)
    assert all(m[f"{s}_{k}_ms"] is not None for s in loadgen.STATS for k in loadgen.SERIES)
    assert m["request_rate"] == rate and m["max_concurrency"] == concurrency and m["ttft_is_e2e"] is False


def test_shortfin_run_falls_back_to_one_body(server_url, tokenizer_path):
    w = loadgen.make_workload("random", tokenizer_path, num_requests=3, input_len=8, output_len=7)
    m = loadgen.run("shortfin", server_url, w, concurrency=3)
    assert m["completed"] == 3 and m["ttft_is_e2e"] is True
    assert m["total_output_tokens"] == 21  # counted with the tokenizer: the server gave no usage
    assert m["mean_itl_ms"] is None


def test_warmup_failure_stops_the_run(tokenizer_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    w = loadgen.make_workload("random", tokenizer_path, num_requests=2, input_len=4, output_len=2)
    with pytest.raises(RuntimeError, match="warm-up"):
        loadgen.bench("openai", dead, w, model="fake")


def test_cli_writes_json(server_url, tokenizer_path, tmp_path, capsys):
    out = tmp_path / "m.json"
    code = loadgen.main(["--base-url", server_url, "--tokenizer", str(tokenizer_path), "--num-requests", "3",
                         "--input-len", "6", "--output-len", "3", "--concurrency", "2", "--json", str(out)])
    assert code == 0
    saved = json.loads(out.read_text())
    assert saved["metrics"]["completed"] == 3 and len(saved["requests"]) == 3
    first = saved["requests"][0]
    assert {"start", "ttft", "itl", "latency", "end", "output_tokens", "error"} <= set(first)
    assert first["end"] == pytest.approx(first["start"] + first["latency"])
    assert "TTFT" in capsys.readouterr().out


# -- guidellm's report ----------------------------------------------------------------------------

def _summary(values: list[float], p50: float, p90: float, p99: float) -> dict:
    return {"successful": {"mean": sum(values) / len(values), "count": len(values), "total_sum": sum(values),
                           "percentiles": {"p50": p50, "p90": p90, "p99": p99}}}


def test_guidellm_report_maps_to_the_same_keys():
    """The shape of a guidellm 0.8.1 JSON report (trimmed): latency in s, the rest in ms."""
    report = {"benchmarks": [{"duration": 4.0, "metrics": {
        "request_totals": {"successful": 2, "errored": 1, "incomplete": 0, "total": 3},
        "time_to_first_token_ms": _summary([100.0, 300.0], 100.0, 300.0, 300.0),
        "inter_token_latency_ms": _summary([20.0] * 6, 20.0, 20.0, 20.0),
        "request_latency": _summary([0.5, 0.7], 0.5, 0.7, 0.7),
        "prompt_token_count": _summary([256.0, 256.0], 256.0, 256.0, 256.0),
        "output_token_count": _summary([4.0, 4.0], 4.0, 4.0, 4.0),
    }, "requests": {"errored": [{"info": {"error": "HTTP 503"}}]}}]}
    m = guidellm_runner.metrics_from_report(report, workload="random", rate=2.0, concurrency=None)
    assert list(m) == list(loadgen.METRIC_KEYS)
    assert m["tool"] == "guidellm" and (m["completed"], m["failed"], m["num_requests"]) == (2, 1, 3)
    assert m["p90_ttft_ms"] == 300.0 and m["mean_ttft_ms"] == 200.0
    assert m["mean_tpot_ms"] == 20.0 and m["mean_itl_ms"] == 20.0 and m["p50_itl_ms"] is None
    assert m["p50_e2el_ms"] == pytest.approx(500.0) and m["mean_e2el_ms"] == pytest.approx(600.0)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (512, 8)
    assert m["output_throughput"] == pytest.approx(2.0) and m["request_throughput"] == pytest.approx(0.5)
    assert m["errors"] == ["HTTP 503"] and m["request_rate"] == 2.0


def test_guidellm_profiles():
    assert guidellm_runner.profile(2.0, None) == {"kind": "poisson", "rate": [2.0]}
    assert guidellm_runner.profile(2.0, 8) == {"kind": "poisson", "rate": [2.0], "max_concurrency": 8}
    assert guidellm_runner.profile(None, 16) == {"kind": "concurrent", "streams": [16]}
    assert guidellm_runner.profile(None, None) == {"kind": "throughput"}
