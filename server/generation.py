"""One API request's prompts in flight: admitted, submitted together, their events merged, aborted together.

Routes (OpenAI, shortfin, WebSocket) differ in how they format results, not in how they
run them; this is the part they share, the checks every route makes first included. It
also times each sequence's tokens for the latency histograms, and observes each request
whose sequences have all finished (tokens in and out, time queued). Leaving `events()` early,
for whatever reason (a client gone, a cancelled task), aborts every prompt still
running, so their pages return at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from kiln.runtime.errors import InvalidRequestError, ModelNotFoundError, shown
from kiln.runtime.request import Completion, Event, Request, TokenLogprob
from kiln.runtime.sampling import SamplingParams
from kiln.runtime.service import GenerateService

from .metrics import Metrics
from .settings import ServerSettings


def admit(service: GenerateService, settings: ServerSettings, model: str | None, n_values=(1,)) -> None:
    """What every generation route checks first: the model's name (the model's, or a LoRA
    adapter's), that the service is ready, n."""
    check_model(settings, model, service)
    service.check_ready()
    check_n(settings, n_values)


def adapter_of(service: GenerateService, model: str | None) -> str | None:
    """The LoRA adapter a request's `model` names; None for the model itself."""
    loras = service.loras
    return model if loras is not None and model in loras.adapters else None


def check_model(settings: ServerSettings, model: str | None, service: GenerateService | None = None) -> None:
    """A 404 naming what this server serves, for a model it does not (no name: its own); with
    `service`, its LoRA adapters' names are models too."""
    if not settings.knows_model(model) and (service is None or adapter_of(service, model) is None):
        known = ", ".join(map(repr, settings.served_model_names))
        raise ModelNotFoundError(f"the model {shown(model)} does not exist: this server serves {known}",
                                 param="model")


def check_n(settings: ServerSettings, n_values) -> None:
    for n in n_values:
        if not 1 <= n <= settings.max_n:
            raise InvalidRequestError(f"n must be in [1, {settings.max_n}], got {n}", param="n")


def check_limits(settings: ServerSettings, params: SamplingParams) -> None:
    """The server's limits on one prompt's sequences (n, and the beams of a beam search), after
    the fields' own checks: every front door, HTTP or gRPC, passes here before anything is
    allocated for the request."""
    params.validate()
    check_n(settings, [params.n])
    if params.num_beams > settings.max_n:
        raise InvalidRequestError(f"the beam width must be in [1, {settings.max_n}], got {params.num_beams}",
                                  param="best_of")


def check_queue_room(service: GenerateService, params: list[SamplingParams]) -> None:
    """A request whose sequences (each prompt's n, or its beams) outnumber what the queue can
    ever hold would be refused as busy however long it waited: it is a 400 instead, naming the
    bound. (A queue of 0 holds nothing, and answers every request busy.)"""
    room = service.config.max_queue
    sequences = sum(p.sequence_count for p in params)
    if 0 < room < sequences:
        raise InvalidRequestError(f"the request runs {sequences} sequences (its prompts times n), more than the "
                                  f"{room} the server's queue holds (--max-queue): send fewer at once", param="n")


def rest_of_context(service: GenerateService, prompt: list[int]) -> int:
    """The default max_tokens where a route has none of its own (the service's: what is left of
    the context, or a diffusion LM's default canvas)."""
    return service.default_max_tokens(len(prompt))


@contextlib.contextmanager
def _naming_prompt(index: int | None):
    """An InvalidRequestError raised inside names the prompt it is about (of several)."""
    try:
        yield
    except InvalidRequestError as error:
        if index is None:
            raise
        raise InvalidRequestError(f"prompt {index}: {error.message}", param=error.param) from None


# One sequence's accumulated output.
Choice = Completion


@dataclass
class PromptResult:
    prompt_ids: list[int]
    choices: list[Choice]
    prompt_logprobs: list[TokenLogprob | None] | None = None
    cached_tokens: int = 0


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # A diffusion LM's: forward passes (NFE) and the canvas each sequence got (max_tokens
    # rounded up to whole blocks); None for an autoregressive model.
    forward_passes: int | None = None
    canvas_tokens: int | None = None

    def to_json(self) -> dict:
        usage = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }
        if self.forward_passes is not None:
            usage["forward_passes"] = self.forward_passes
            usage["tokens_per_forward"] = round(self.completion_tokens / max(1, self.forward_passes), 3)
            usage["canvas_tokens"] = self.canvas_tokens
        return usage


class Generation:
    def __init__(self, service: GenerateService, settings: ServerSettings, metrics: Metrics | None,
                 prompts: list[list[int]], params: list[SamplingParams], request_ids: list[str], priority: int = 0):
        self.service = service
        self.settings = settings
        self.metrics = metrics
        self.prompts = prompts
        self.params = params
        self.request_ids = request_ids
        self.priority = priority
        self.requests: list[Request] = []
        self.completion_tokens = 0
        self._started = 0.0
        self._last_token: dict[tuple[int, int], float] = {}
        self._open_sequences = [p.n for p in params]  # per prompt: its request ends when none is left
        self._generated = [0] * len(prompts)  # per prompt, all its sequences' tokens
        self._aborted: set[str] = set()

    # -- in ---------------------------------------------------------------------------------
    async def submit(self) -> "Generation":
        """Check and submit every prompt, or none: a bad prompt or a full queue withdraws the
        others. Structured-output grammars compile first, off the event loop."""
        self._started = time.monotonic()
        many = len(self.prompts) > 1
        try:
            for index, params in enumerate(self.params):
                with _naming_prompt(index if many else None):
                    check_limits(self.settings, params)
            check_queue_room(self.service, self.params)
            await self.service.compile_grammars(self.params)
            for index, (ids, params, request_id) in enumerate(zip(self.prompts, self.params, self.request_ids)):
                # A LoRA adapter's slot, held until the request ends (submit lets go of a refused one's).
                adapter = await self.service.hold_adapter(params.lora) if params.lora is not None else None
                with _naming_prompt(index if many else None):
                    self.requests.append(self.service.submit(ids, params, request_id, self.priority, adapter))
        except BaseException:
            self.abort()
            raise
        return self

    # -- out --------------------------------------------------------------------------------
    async def events(self) -> AsyncIterator[tuple[int, Event]]:
        """(prompt index, event) as they come, until every sequence of every prompt finishes."""
        try:
            if len(self.requests) == 1:
                async for event in self.service.stream(self.requests[0]):
                    self._observe(0, event)
                    yield 0, event
                return
            merged: asyncio.Queue = asyncio.Queue()
            done = object()

            async def pump(index: int, request: Request):
                try:
                    async for event in self.service.stream(request):
                        merged.put_nowait((index, event))
                finally:
                    merged.put_nowait(done)

            pumps = [asyncio.create_task(pump(i, r)) for i, r in enumerate(self.requests)]
            try:
                open_pumps = len(pumps)
                while open_pumps:
                    item = await merged.get()
                    if item is done:
                        open_pumps -= 1
                        continue
                    self._observe(*item)
                    yield item
            finally:
                for task in pumps:
                    task.cancel()
        finally:
            self.abort()

    async def collect(self) -> list[PromptResult]:
        results = [PromptResult(list(ids), [Choice() for _ in range(p.n)]) for ids, p in zip(self.prompts, self.params)]
        async with contextlib.aclosing(self.events()) as events:
            async for index, event in events:
                results[index].choices[event.index].add(event)
                if event.prompt_logprobs is not None:
                    results[index].prompt_logprobs = event.prompt_logprobs
        for result, request in zip(results, self.requests):
            result.cached_tokens = request.cached_tokens
        return results

    def usage(self) -> Usage:
        usage = Usage(
            prompt_tokens=sum(len(ids) for ids in self.prompts),
            completion_tokens=self.completion_tokens,
            cached_tokens=sum(r.cached_tokens for r in self.requests),
        )
        if any(r.canvas_tokens for r in self.requests):  # a diffusion LM's: passes, not steps
            usage.forward_passes = sum(r.forward_passes for r in self.requests)
            usage.canvas_tokens = max((r.canvas_tokens for r in self.requests), default=0)
        return usage

    def abort(self) -> None:
        """Stop whatever is still running (idempotent; finished requests are left alone)."""
        for request in self.requests:
            if not request.finished and request.request_id not in self._aborted:
                self._aborted.add(request.request_id)
                if self.metrics is not None:  # their "abort" events will not be read: count them here
                    self.metrics.finished.labels("abort").inc(request.unfinished)
                self.service.abort(request.request_id)

    def _observe(self, index: int, event: Event) -> None:
        now = time.monotonic()
        key = (index, event.index)
        if event.token_ids:
            self.completion_tokens += len(event.token_ids)
            self._generated[index] += len(event.token_ids)
            if self.metrics is not None:
                last = self._last_token.get(key)
                if last is None:
                    self.metrics.time_to_first_token.observe(now - self._started)
                else:
                    self.metrics.inter_token_latency.observe(now - last)
            self._last_token[key] = now
        if event.finish_reason and self.metrics is not None:
            self.metrics.finished.labels(event.finish_reason).inc()
            self.metrics.request_latency.observe(now - self._started)
            self._open_sequences[index] -= 1
            if not self._open_sequences[index]:
                self.metrics.request_finished(self.requests[index], self._generated[index])
