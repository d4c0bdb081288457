"""The batcher: one asyncio task that steps the model for every request in flight.

Each step is three calls, as in nano-vllm: the scheduler decides a batch, the
executor runs it, and `postprocess` samples, detokenizes, applies stop rules and
sends each sequence's new text to its request's queue. Aborts are applied
between steps, so pages never change hands while the device writes to them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import numpy as np

from .detokenizer import IncrementalDetokenizer, StopChecker
from .executor import Executor, InvocationError
from .request import Event, Request, Sequence, SequenceStatus, TokenLogprob
from .sampling import Sampler, compute_logprobs_rows
from .scheduler import Batch, Scheduler

log = logging.getLogger("kiln.batcher")


@dataclass
class BatcherCounters:
    steps: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    failed_batches: int = 0


class Batcher:
    def __init__(self, scheduler: Scheduler, executor: Executor, tokenizer, eos_token_ids: list[int], max_seq_len: int):
        self.scheduler = scheduler
        self.executor = executor
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.max_seq_len = max_seq_len
        self.sampler = Sampler(eos_token_ids)
        self.counters = BatcherCounters()
        self.requests: dict[str, Request] = {}
        self._pending_aborts: set[str] = set()
        self._wake = asyncio.Event()
        self._stopping = False
        self._task: asyncio.Task | None = None

    # -- requests in and out ----------------------------------------------------------
    def submit(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        leader = None
        for index in range(request.params.n):
            seq = Sequence(request, index, leader=leader)
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer, request.prompt_ids, skip_special_tokens=request.params.skip_special_tokens
            )
            seq.stop_checker = StopChecker(request.params.stop)
            request.sequences.append(seq)
            leader = leader or seq
        self.requests[request.request_id] = request
        for seq in request.sequences:
            self.scheduler.add(seq)
        self.counters.prompt_tokens += len(request.prompt_ids)
        self._wake.set()

    def abort(self, request_id: str) -> None:
        """Stop a request; its pages come back before the next step."""
        if request_id in self.requests:
            self._pending_aborts.add(request_id)
            self._wake.set()

    def _apply_aborts(self) -> None:
        for request_id in self._pending_aborts:
            request = self.requests.get(request_id)
            if request is None:
                continue
            for seq in request.sequences:
                if seq.status is not SequenceStatus.FINISHED:
                    self._finish(seq, "abort")
        self._pending_aborts.clear()

    def _finish(self, seq: Sequence, reason: str, stop_reason=None, error: str | None = None, text: str = "") -> None:
        self.scheduler.finish(seq, reason)
        seq.emit(Event(seq.index, text=text, finish_reason=reason, stop_reason=stop_reason, error=error))
        if seq.request.finished:
            self.requests.pop(seq.request.request_id, None)

    # -- the loop ---------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.run(), name="kiln-batcher")

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            await self._task

    async def run(self) -> None:
        while not self._stopping:
            self._apply_aborts()
            batch = self.scheduler.schedule()
            if batch is None:
                self._wake.clear()
                if not self._pending_aborts:
                    await self._wake.wait()
                continue
            try:
                logits = await self.executor.run(batch)
            except InvocationError as error:
                log.error("batch of %d failed: %s", len(batch.seqs), error)
                self.counters.failed_batches += 1
                for seq in batch.seqs:
                    if seq.status is not SequenceStatus.FINISHED:
                        self._finish(seq, "error", error=str(error))
                continue
            try:
                self.postprocess(batch, logits)
            except Exception as error:  # never let one bad row stop every request
                log.exception("postprocess failed")
                for seq in batch.seqs:
                    if seq.status is not SequenceStatus.FINISHED:
                        self._finish(seq, "error", error=f"internal error: {error}")
            # Let request handlers run between steps even when the device is fast.
            await asyncio.sleep(0)

    # -- after a step -----------------------------------------------------------------
    def postprocess(self, batch: Batch, logits: list[np.ndarray | None]) -> None:
        self.counters.steps += 1
        if batch.kind == "prefill":
            self.counters.prefill_steps += 1
        else:
            self.counters.decode_steps += 1
        for seq, start, chunk, samples, row_logits in zip(batch.seqs, batch.starts, batch.chunks, batch.samples, logits):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted while the batch ran
            if row_logits is not None and row_logits.ndim == 2:  # every position: prompt logprobs
                self._record_prompt_logprobs(seq, start, row_logits)
                row_logits = row_logits[-1]
            seq.computed += len(chunk)
            if batch.kind == "prefill":
                self.scheduler.publish(seq)
            if samples:
                self._append_token(seq, row_logits)

    def _record_prompt_logprobs(self, seq: Sequence, start: int, logits: np.ndarray) -> None:
        """Logits at position p score prompt token p + 1: keep those, by position."""
        if seq.prompt_logprobs is None:
            return
        count = min(len(logits), seq.prompt_len - 1 - start)
        if count <= 0:
            return
        targets = seq.tokens[start + 1 : start + 1 + count]
        rows = compute_logprobs_rows(logits[:count], targets, seq.request.params.prompt_logprobs)
        for offset, (token, (logprob, top)) in enumerate(zip(targets, rows)):
            seq.prompt_logprobs[start + 1 + offset] = TokenLogprob(token, logprob, top)

    def _append_token(self, seq: Sequence, logits: np.ndarray) -> None:
        params = seq.request.params
        result = self.sampler.sample(logits, params, seq.rng, seq.output_ids, seq.tokens[: seq.prompt_len])
        token = result.token_id
        if seq.request.first_token_time is None:
            seq.request.first_token_time = time.monotonic()
        seq.tokens.append(token)
        self.counters.generated_tokens += 1
        generated = len(seq.tokens) - seq.prompt_len

        finish, stop_reason = None, None
        if token in self.eos_token_ids and not params.ignore_eos:
            finish, stop_reason = "stop", token
        elif token in params.stop_token_ids:
            finish, stop_reason = "stop", token
        delta = "" if finish else seq.detokenizer.add(token)
        text, stopped = seq.stop_checker.feed(delta)
        if stopped:
            finish, stop_reason = "stop", seq.stop_checker.matched
        elif finish is None and (generated >= params.max_tokens or len(seq.tokens) >= self.max_seq_len):
            finish = "length"
        if finish is not None and not stopped:
            # Release what the detokenizer and the stop checker still hold.
            tail, stopped = seq.stop_checker.feed(seq.detokenizer.flush())
            text += tail
            if stopped:
                finish, stop_reason = "stop", seq.stop_checker.matched
            else:
                text += seq.stop_checker.finish()
        logprobs = [] if result.logprob is None else [TokenLogprob(token, result.logprob, result.top_logprobs or {})]
        event = Event(seq.index, text=text, token_ids=[token], logprobs=logprobs,
                      prompt_logprobs=seq.take_prompt_logprobs())
        if finish is None:
            seq.emit(event)
        else:
            # The last event carries the last token and the reason together.
            self.scheduler.finish(seq, finish)
            event.finish_reason, event.stop_reason = finish, stop_reason
            seq.emit(event)
            if seq.request.finished:
                self.requests.pop(seq.request.request_id, None)
