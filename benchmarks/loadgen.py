"""Serving load generator: vLLM's / SGLang's serving-benchmark protocol for Kiln and its peers.

A workload is N prompts of exact token lengths (random ids from the model's vocabulary,
decoded and re-checked with the model's tokenizer, so every engine sees the same text), each
asking for a fixed number of output tokens with `ignore_eos` and greedy sampling, streamed.
Requests arrive as a seeded Poisson process at a given rate, or all at once ("as fast as
possible"), optionally capped by a concurrency semaphore; one warm-up request goes first.
Per request we record the start, TTFT (first streamed chunk with text), every inter-token
gap, the end (last text chunk) and the output token count (the server's `usage` if it gives
one, else the text re-tokenized), and aggregate them the way vLLM's benchmark_serving does.

    python -m benchmarks.loadgen --base-url http://127.0.0.1:8000 --backend openai \
        --tokenizer ARTIFACTS/tokenizer.json --concurrency 16 --num-requests 32 --json out.json

Backends: `openai` (POST /v1/completions, SSE: Kiln, llama.cpp's llama-server),
`shortfin` (POST /generate: streamed events when the server streams, else one JSON body,
in which case TTFT is the whole latency and the result says so with `ttft_is_e2e`), and
`chat` and `anthropic` (the prompt as a user message through /v1/chat/completions or
Anthropic's /v1/messages, ending at the model's end of turn: the one API beside the other).
"""

from __future__ import annotations

import abc
import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from tokenizers import Tokenizer

# -- workloads ----------------------------------------------------------------------------------


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The model's tokenizer.json (a file, or the directory holding it)."""
    path = Path(path)
    return Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path))


def _count(tok: Tokenizer, text: str) -> int:
    return len(tok.encode(text, add_special_tokens=False).ids)


def _exact_text(tok: Tokenizer, rng: random.Random, length: int, pool: list[int]) -> tuple[str, list[int]]:
    """Text that tokenizes to exactly `length` tokens. Decoding random ids and encoding the text
    again rarely gives the same ids (merges, partial UTF-8), so trim or top up until it holds."""
    ids = [rng.choice(pool) for _ in range(length)]
    for _ in range(50):
        text = tok.decode(ids, skip_special_tokens=True)
        again = tok.encode(text, add_special_tokens=False).ids
        if len(again) == length:
            return text, again
        ids = again[:length] + [rng.choice(pool) for _ in range(length - len(again))]
    raise RuntimeError(f"could not make a prompt of exactly {length} tokens")


def _vocabulary(tok: Tokenizer) -> list[int]:
    """Ordinary token ids: no special or added tokens (<|im_start|>, EOS...)."""
    special = set(tok.get_added_tokens_decoder())
    return [i for i in range(tok.get_vocab_size(with_added_tokens=False)) if i not in special]


@dataclass
class Workload:
    """The requests of one run, and how they were made (so another tool can make the same)."""

    kind: str  # "random" | "shared_prefix"
    prompts: list[str]
    prompt_lens: list[int]
    output_len: int
    warmup_prompt: str  # shares nothing with the measured prompts (a cached prefix would skew them)
    tokenizer_path: str
    seed: int = 0
    input_len: int = 0  # random: tokens per prompt
    prefix_len: int = 0  # shared_prefix: the common part, in tokens
    suffix_len: int = 0

    def __len__(self) -> int:
        return len(self.prompts)


def random_workload(tokenizer_path: str | Path, num_requests: int = 32, input_len: int = 256,
                    output_len: int = 128, seed: int = 0) -> Workload:
    """vLLM's `random` dataset: prompts of `input_len` random vocabulary tokens."""
    tok, rng = load_tokenizer(tokenizer_path), random.Random(seed)
    pool = _vocabulary(tok)
    prompts = [_exact_text(tok, rng, input_len, pool)[0] for _ in range(num_requests)]
    warmup = _exact_text(tok, random.Random(seed + 10_007), input_len, pool)[0]
    return Workload("random", prompts, [input_len] * num_requests, output_len, warmup,
                    str(tokenizer_path), seed, input_len=input_len)


def shared_prefix_workload(tokenizer_path: str | Path, num_requests: int = 32, prefix_len: int = 1024,
                           suffix_len: int = 32, output_len: int = 32, seed: int = 0) -> Workload:
    """One long common prefix plus a short distinct suffix per request: what a prefix cache is
    for. Each prompt is checked to tokenize as the prefix's exact ids followed by the suffix
    (a merge across the seam would change the prefix's last token and defeat the cache)."""
    tok, rng = load_tokenizer(tokenizer_path), random.Random(seed)
    pool = _vocabulary(tok)
    prefix, prefix_ids = _exact_text(tok, rng, prefix_len, pool)
    prompts: list[str] = []
    while len(prompts) < num_requests:
        for _ in range(100):
            suffix_ids = _exact_text(tok, rng, suffix_len, pool)[1]
            text = tok.decode(prefix_ids + suffix_ids, skip_special_tokens=True)
            ids = tok.encode(text, add_special_tokens=False).ids
            if ids[:prefix_len] == prefix_ids and len(ids) == prefix_len + suffix_len and text.startswith(prefix):
                prompts.append(text)
                break
        else:
            raise RuntimeError("no suffix keeps the prefix's tokens intact")
    warmup = _exact_text(tok, random.Random(seed + 10_007), prefix_len + suffix_len, pool)[0]
    return Workload("shared_prefix", prompts, [prefix_len + suffix_len] * num_requests, output_len, warmup,
                    str(tokenizer_path), seed, prefix_len=prefix_len, suffix_len=suffix_len)


def make_workload(kind: str, tokenizer_path: str | Path, num_requests: int = 32, seed: int = 0,
                  **options: int) -> Workload:
    """`random` (256 in / 128 out by default) or `shared_prefix` (1024 + 32 in / 32 out)."""
    makers = {"random": random_workload, "shared_prefix": shared_prefix_workload}
    if kind not in makers:
        raise ValueError(f"unknown workload {kind!r}: {', '.join(makers)}")
    return makers[kind](tokenizer_path, num_requests=num_requests, seed=seed, **options)


# -- one request --------------------------------------------------------------------------------


@dataclass
class RequestResult:
    """One request's timeline, in seconds (`start` on the run's clock, the rest relative)."""

    prompt_len: int = 0
    start: float = 0.0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    latency: float | None = None  # start to the last text chunk (vLLM's E2E)
    output_tokens: int | None = None  # the server's count, if it gave one
    text: str = ""
    error: str = ""
    ttft_is_e2e: bool = False  # non-streaming answer: the first token came with the last

    @property
    def ok(self) -> bool:
        return not self.error and self.ttft is not None

    def record(self) -> dict:
        """What the JSON keeps of a request: its timeline (with `end`), counts and error; no text."""
        end = None if self.latency is None else self.start + self.latency
        return {**{k: v for k, v in asdict(self).items() if k != "text"}, "end": end}

    def chunk(self, now: float, text: str, t0: float) -> None:
        """A streamed piece of text arrived at `now` (perf_counter; `t0` is the request's send time)."""
        if not text:
            return
        elapsed = now - t0
        if self.ttft is None:
            self.ttft = elapsed
        else:
            self.itl.append(elapsed - self.latency)
        self.latency = elapsed
        self.text += text


class SSEParser:
    """Incremental server-sent events: network chunks in, (event, data) pairs out.

    Chunks split events anywhere, even inside a UTF-8 character, so bytes wait for their line
    to end; an event ends at a blank line; several `data:` lines join with newlines (the SSE
    spec). llama.cpp's nonstandard `error: {...}` line comes out as an "error" event."""

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []
        self._event = "message"

    def feed(self, chunk: bytes) -> list[tuple[str, str]]:
        self._buffer += chunk
        events: list[tuple[str, str]] = []
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            self._line(line.rstrip(b"\r").decode("utf-8", "replace"), events)
        return events

    def close(self) -> list[tuple[str, str]]:
        """What a stream that ended without its final blank line still held."""
        events: list[tuple[str, str]] = []
        if self._buffer:
            self._line(self._buffer.rstrip(b"\r").decode("utf-8", "replace"), events)
            self._buffer = b""
        self._line("", events)
        return events

    def _line(self, line: str, events: list[tuple[str, str]]) -> None:
        if not line:
            if self._data:
                events.append((self._event, "\n".join(self._data)))
            self._data, self._event = [], "message"
            return
        if line.startswith(":"):
            return  # a comment (keep-alive)
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "error":
            self._event = "error"
            self._data.append(value)


def _error_text(payload: Any) -> str:
    if isinstance(payload, dict):
        error = payload.get("error", payload)
        if isinstance(error, dict):
            return str(error.get("message") or error)
        return str(error)
    return str(payload)


async def _http_error(response: httpx.Response) -> str:
    body = (await response.aread()).decode("utf-8", "replace")
    return f"HTTP {response.status_code}: {body[:300]}"


class _Backend(abc.ABC):
    """One request: POST the payload, read an SSE stream (or, where `streams` says no, one body)."""

    path = ""
    no_text = "the response carried no text"

    def __init__(self, base_url: str):
        self.base_url = base_url.rstrip("/")

    async def prepare(self, client: httpx.AsyncClient) -> None:
        return None

    @abc.abstractmethod
    def payload(self, prompt: str, max_tokens: int) -> dict:
        """The request body."""

    def streams(self, response: httpx.Response) -> bool:
        return True

    def on_body(self, result: RequestResult, now: float, t0: float, body: bytes) -> None:
        result.error = f"expected a stream, got: {body[:200]!r}"

    @classmethod
    def on_event(cls, result: RequestResult, now: float, t0: float, event: str, data: str) -> None:
        """One SSE event: the end and errors here, the backend's own payload in on_payload."""
        if result.error or data == "[DONE]":
            return
        try:
            payload = json.loads(data)
        except json.JSONDecodeError:
            payload = None
        if event == "error" or (isinstance(payload, dict) and "error" in payload):
            result.error = _error_text(data if payload is None else payload)
            return
        cls.on_payload(result, now, t0, data, payload)

    @staticmethod
    @abc.abstractmethod
    def on_payload(result: RequestResult, now: float, t0: float, data: str, payload: Any) -> None:
        """One event's JSON (None when it is not JSON)."""

    async def send(self, client: httpx.AsyncClient, prompt: str, max_tokens: int) -> RequestResult:
        result = RequestResult()
        t0 = time.perf_counter()
        try:
            async with client.stream("POST", f"{self.base_url}{self.path}",
                                     json=self.payload(prompt, max_tokens)) as response:
                if response.status_code != 200:
                    result.error = await _http_error(response)
                    return result
                if self.streams(response):
                    parser = SSEParser()
                    async for chunk in response.aiter_bytes():
                        now = time.perf_counter()
                        for event, data in parser.feed(chunk):
                            self.on_event(result, now, t0, event, data)
                    for event, data in parser.close():
                        self.on_event(result, time.perf_counter(), t0, event, data)
                else:
                    self.on_body(result, time.perf_counter(), t0, await response.aread())
        except Exception as error:  # noqa: BLE001 - recorded: a failed request is a result too
            result.error = result.error or f"{type(error).__name__}: {error}"
        if not result.error and result.ttft is None:
            result.error = self.no_text
        return result


class OpenAIBackend(_Backend):
    """POST {base}/v1/completions, streamed with usage: Kiln and llama.cpp's llama-server."""

    name = "openai"
    path = "/v1/completions"
    no_text = "the stream carried no text"

    def __init__(self, base_url: str, model: str | None = None):
        super().__init__(base_url)
        self.model = model

    async def prepare(self, client: httpx.AsyncClient) -> None:
        """Ask /v1/models for the name when none was given (Kiln answers 404 to a wrong one)."""
        if self.model is not None:
            return
        try:
            response = await client.get(f"{self.base_url}/v1/models")
            self.model = response.json()["data"][0]["id"]
        except Exception:  # noqa: BLE001 - a server without /v1/models takes no model name
            self.model = None

    def payload(self, prompt: str, max_tokens: int) -> dict:
        body = {**self.prompt_fields(prompt), "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        if self.model:
            body["model"] = self.model
        return body

    @staticmethod
    def prompt_fields(prompt: str) -> dict:
        return {"prompt": prompt, "ignore_eos": True}

    @staticmethod
    def text_of(choice: dict) -> str:
        return choice.get("text") or ""

    @classmethod
    def on_payload(cls, result: RequestResult, now: float, t0: float, data: str, payload: Any) -> None:
        if not isinstance(payload, dict):
            result.error = f"not JSON in the stream: {data[:200]}"
            return
        choices = payload.get("choices") or []
        if choices:
            result.chunk(now, cls.text_of(choices[0]), t0)
        if usage := payload.get("usage"):
            result.output_tokens = usage.get("completion_tokens", result.output_tokens)


class ShortfinBackend(_Backend):
    """shortfin's POST {base}/generate. It asks to stream; shortfin 3.9.0 accepts `stream` but
    answers one JSON body anyway, so both shapes are read: SSE events (Kiln's JSON events, or
    plain `data: <text>`), or `{"responses": [{"responses": [{"text"}]}]}` (TTFT = E2E then).
    No `temperature`: shortfin is greedy by default and rejects a temperature other than 1
    when its model normalizes logits; it has no `ignore_eos` either, so outputs may be shorter."""

    name = "shortfin"
    path = "/generate"

    def __init__(self, base_url: str, stream: bool = True):
        super().__init__(base_url)
        self.stream = stream

    def payload(self, prompt: str, max_tokens: int) -> dict:
        return {"text": prompt, "sampling_params": {"max_completion_tokens": max_tokens}, "stream": self.stream}

    def streams(self, response: httpx.Response) -> bool:
        return "text/event-stream" in response.headers.get("content-type", "")

    @staticmethod
    def on_payload(result: RequestResult, now: float, t0: float, data: str, payload: Any) -> None:
        if not isinstance(payload, dict):  # shortfin's older streaming: the text itself
            result.chunk(now, data, t0)
            return
        result.chunk(now, payload.get("text") or "", t0)
        if payload.get("token_ids") is not None:
            result.output_tokens = (result.output_tokens or 0) + len(payload["token_ids"])

    @staticmethod
    def on_body(result: RequestResult, now: float, t0: float, body: bytes) -> None:
        try:
            payload = json.loads(body)
            text = payload["responses"][0]["responses"][0]["text"]
        except (ValueError, KeyError, IndexError, TypeError):
            result.error = f"unexpected /generate body: {body[:200]!r}"
            return
        result.chunk(now, text, t0)
        result.ttft_is_e2e = True


class ChatBackend(OpenAIBackend):
    """POST {base}/v1/chat/completions: the prompt as one user message, rendered by the chat
    template, greedy and streamed with usage, ending where the model ends its turn (no
    `ignore_eos`, which Anthropic's API has no word for), so it pairs with `anthropic`."""

    name = "chat"
    path = "/v1/chat/completions"

    @staticmethod
    def prompt_fields(prompt: str) -> dict:
        return {"messages": [{"role": "user", "content": prompt}]}

    @staticmethod
    def text_of(choice: dict) -> str:
        return (choice.get("delta") or {}).get("content") or ""


class AnthropicBackend(OpenAIBackend):
    """POST {base}/v1/messages, Anthropic's Messages API: the same request as `chat`, streamed
    as Anthropic's events (text in content_block_delta, the output tokens in message_delta)."""

    name = "anthropic"
    path = "/v1/messages"

    def payload(self, prompt: str, max_tokens: int) -> dict:
        return {"model": self.model or "", "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens, "temperature": 0, "stream": True}

    @staticmethod
    def on_payload(result: RequestResult, now: float, t0: float, data: str, payload: Any) -> None:
        if not isinstance(payload, dict):
            result.error = f"not JSON in the stream: {data[:200]}"
            return
        delta = payload.get("delta") or {}
        if payload.get("type") == "content_block_delta" and delta.get("type") == "text_delta":
            result.chunk(now, delta.get("text") or "", t0)
        elif payload.get("type") == "message_delta":
            result.output_tokens = (payload.get("usage") or {}).get("output_tokens", result.output_tokens)


BACKENDS = {"openai": OpenAIBackend, "chat": ChatBackend, "anthropic": AnthropicBackend, "shortfin": ShortfinBackend}


def make_backend(name: str, base_url: str, **options: Any):
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}: {', '.join(BACKENDS)}")
    return BACKENDS[name](base_url, **options)


# -- a run --------------------------------------------------------------------------------------


def arrival_offsets(count: int, rate: float | None, seed: int = 0) -> list[float]:
    """When each request is sent, in seconds from the start: a Poisson process of `rate`
    requests/s (exponential gaps, the first at 0), or all at 0 for no rate (or infinity)."""
    if rate is None or math.isinf(rate):
        return [0.0] * count
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    rng, offsets, now = random.Random(seed), [], 0.0
    for i in range(count):
        if i:
            now += rng.expovariate(rate)
        offsets.append(now)
    return offsets


# A request with no complete answer after this long counts as failed (a hung server).
REQUEST_TIMEOUT_S = 900.0


async def _drive(backend, workload: Workload, rate: float | None, concurrency: int | None,
                 seed: int, request_timeout: float = REQUEST_TIMEOUT_S) -> tuple[list[RequestResult], float]:
    """Warm up, then send every request on its schedule; returns the results and the duration."""
    n = len(workload)
    connections = max(1, min(concurrency or n, n))
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    timeout = httpx.Timeout(None, connect=30.0)  # a queued request may wait long for its first byte
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        await backend.prepare(client)
        warm = await backend.send(client, workload.warmup_prompt, min(workload.output_len, 16))
        if not warm.ok:
            raise RuntimeError(f"the warm-up request failed: {warm.error}")
        offsets = arrival_offsets(n, rate, seed)
        gate = asyncio.Semaphore(concurrency) if concurrency else None
        t0 = time.perf_counter()

        async def one(i: int) -> RequestResult:
            delay = t0 + offsets[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if gate is not None:
                async with gate:
                    return await timed(i)
            return await timed(i)

        async def timed(i: int) -> RequestResult:
            start = time.perf_counter() - t0
            try:
                result = await asyncio.wait_for(backend.send(client, workload.prompts[i], workload.output_len),
                                                request_timeout)
            except asyncio.TimeoutError:  # a hung server must not hang the whole run
                result = RequestResult(error=f"no complete answer within {request_timeout:.0f} s")
            result.start, result.prompt_len = start, workload.prompt_lens[i]
            return result

        results = await asyncio.gather(*(one(i) for i in range(n)))
        return list(results), time.perf_counter() - t0


def fill_output_tokens(results: list[RequestResult], tokenizer: Tokenizer) -> None:
    """Requests whose server gave no usage: count the text's tokens (vLLM does the same)."""
    for r in results:
        if r.ok and r.output_tokens is None:
            r.output_tokens = _count(tokenizer, r.text)


# -- metrics ------------------------------------------------------------------------------------

STATS = ("mean", "p50", "p90", "p99")
SERIES = ("ttft", "tpot", "itl", "e2el")
METRIC_KEYS = (
    "tool", "backend", "workload", "request_rate", "max_concurrency", "num_requests",
    "completed", "failed", "duration_s", "total_input_tokens", "total_output_tokens",
    "request_throughput", "output_throughput", "total_token_throughput",
    *(f"{stat}_{series}_ms" for series in SERIES for stat in STATS),
    "ttft_is_e2e", "errors",
)


def _stats(values_s: list[float], name: str) -> dict[str, float | None]:
    """mean/p50/p90/p99 in ms (numpy's linear-interpolated percentiles, as vLLM), None if empty."""
    if not values_s:
        return {f"{stat}_{name}_ms": None for stat in STATS}
    ms = np.asarray(values_s, dtype=float) * 1000.0
    return {f"mean_{name}_ms": float(ms.mean()),
            **{f"p{p}_{name}_ms": float(np.percentile(ms, p)) for p in (50, 90, 99)}}


def summarize(results: list[RequestResult], duration_s: float, *, backend: str = "", workload: str = "",
              rate: float | None = None, concurrency: int | None = None, tool: str = "kiln-loadgen") -> dict:
    """vLLM's aggregate over the completed requests: TPOT = (E2E - TTFT) / (output tokens - 1)
    per request (requests of one token have none); ITL pools every gap of every request;
    throughputs divide by the whole run's duration. Non-streamed requests (TTFT = E2E) give no
    TPOT or ITL."""
    done = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    outputs = [r.output_tokens or 0 for r in done]
    streamed = [r for r in done if not r.ttft_is_e2e]
    tpots = [(r.latency - r.ttft) / (n - 1) for r, n in zip(done, outputs) if n > 1 and not r.ttft_is_e2e]
    total_in, total_out = sum(r.prompt_len for r in done), sum(outputs)
    errors: list[str] = []
    for r in failed:
        if r.error not in errors and len(errors) < 5:
            errors.append(r.error)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)
    metrics = {
        "tool": tool, "backend": backend, "workload": workload,
        "request_rate": rate, "max_concurrency": concurrency, "num_requests": len(results),
        "completed": len(done), "failed": len(failed), "duration_s": duration_s,
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": per_s(len(done)), "output_throughput": per_s(total_out),
        "total_token_throughput": per_s(total_in + total_out),
        **_stats([r.ttft for r in done], "ttft"),
        **_stats(tpots, "tpot"),
        **_stats([gap for r in streamed for gap in r.itl], "itl"),
        **_stats([r.latency for r in done], "e2el"),
        "ttft_is_e2e": bool(done) and len(streamed) < len(done),
        "errors": errors,
    }
    return {key: metrics[key] for key in METRIC_KEYS}


def bench(backend: str, base_url: str, workload: Workload, rate: float | None = None,
          concurrency: int | None = None, seed: int = 0, request_timeout: float = REQUEST_TIMEOUT_S,
          **backend_options: Any) -> tuple[dict, list[RequestResult]]:
    """Run `workload` against one server with our client: (metrics, per-request results)."""
    client = make_backend(backend, base_url, **backend_options)
    results, duration = asyncio.run(_drive(client, workload, rate, concurrency, seed, request_timeout))
    fill_output_tokens(results, load_tokenizer(workload.tokenizer_path))
    metrics = summarize(results, duration, backend=backend, workload=workload.kind, rate=rate,
                        concurrency=concurrency)
    return metrics, results


def run(backend: str, base_url: str, workload: Workload, rate: float | None = None,
        concurrency: int | None = None, *, seed: int = 0, **backend_options: Any) -> dict:
    """The metric dict (keys: METRIC_KEYS) for one server and one load (guidellm_runner.run
    gives the same dict from guidellm)."""
    return bench(backend, base_url, workload, rate, concurrency, seed, **backend_options)[0]


# -- the command --------------------------------------------------------------------------------


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def format_table(metrics: dict) -> str:
    """vLLM's result block, compactly: counts and throughputs, then one row per latency series."""
    rate = metrics["request_rate"]
    lines = [
        f"{metrics['tool']} | backend {metrics['backend']} | workload {metrics['workload']} | "
        f"rate {'inf' if rate is None else rate} req/s | max concurrency {_cell(metrics['max_concurrency'])}",
        f"completed {metrics['completed']}/{metrics['num_requests']} (failed {metrics['failed']}) "
        f"in {metrics['duration_s']:.2f} s",
        f"input tokens {metrics['total_input_tokens']}, output tokens {metrics['total_output_tokens']}",
        f"throughput: {metrics['request_throughput']:.3f} req/s, {metrics['output_throughput']:.1f} output tok/s, "
        f"{metrics['total_token_throughput']:.1f} total tok/s",
        f"{'(ms)':<6}" + "".join(f"{stat:>11}" for stat in STATS),
    ]
    for series in SERIES:
        cells = "".join(f"{_cell(metrics[f'{stat}_{series}_ms']):>11}" for stat in STATS)
        lines.append(f"{series.upper():<6}{cells}")
    if metrics["ttft_is_e2e"]:
        lines.append("note: the server did not stream: TTFT is the whole latency, no TPOT/ITL")
    for error in metrics["errors"]:
        lines.append(f"error: {error}")
    return "\n".join(lines)


def arguments(prog: str, description: str) -> argparse.ArgumentParser:
    """The command line of a load: the server, the workload, the load, where to write."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    parser.add_argument("--backend", choices=sorted(BACKENDS), default="openai")
    parser.add_argument("--tokenizer", required=True, help="the model's tokenizer.json (or its directory)")
    parser.add_argument("--model", help="model name for the OpenAI API (default: the first of /v1/models)")
    parser.add_argument("--rate", type=float, help="Poisson arrivals, requests/s (default: all at once)")
    parser.add_argument("--concurrency", type=int, help="at most this many requests in flight")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--workload", choices=["random", "shared_prefix"], default="random")
    parser.add_argument("--input-len", type=int, help="random: prompt tokens (256)")
    parser.add_argument("--output-len", type=int, help="output tokens (random 128, shared_prefix 32)")
    parser.add_argument("--prefix-len", type=int, help="shared_prefix: common tokens (1024)")
    parser.add_argument("--suffix-len", type=int, help="shared_prefix: distinct tokens (32)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write {metrics, requests} here")
    return parser


def workload_of(args: argparse.Namespace) -> Workload:
    options = {k: v for k, v in {"input_len": args.input_len, "output_len": args.output_len,
                                 "prefix_len": args.prefix_len, "suffix_len": args.suffix_len}.items()
               if v is not None}
    return make_workload(args.workload, args.tokenizer, args.num_requests, args.seed, **options)


def report(args: argparse.Namespace, metrics: dict, requests: list[dict]) -> int:
    """Print the metrics, write them (and each request's record) where --json says; the exit status."""
    print(format_table(metrics))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"metrics": metrics, "requests": requests}, indent=1) + "\n")
    return 0 if metrics["completed"] else 1


def main(argv: list[str] | None = None) -> int:
    args = arguments("python -m benchmarks.loadgen", __doc__.split("\n\n")[0]).parse_args(argv)
    backend_options = {"model": args.model} if args.backend in ("openai", "chat", "anthropic") and args.model else {}
    metrics, results = bench(args.backend, args.base_url, workload_of(args), args.rate, args.concurrency, args.seed,
                             **backend_options)
    return report(args, metrics, [r.record() for r in results])


if __name__ == "__main__":
    sys.exit(main())
