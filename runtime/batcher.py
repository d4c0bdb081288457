"""The batcher: one asyncio task that steps the model for every request in flight.

Each step is the same whatever the requests' generation modes (runtime/generation_mode.py),
as in nano-vllm: the scheduler decides a batch, each mode may prepare it (drafts), the
executor runs it, the scheduler counts what it wrote, each row's mode reads its output into
the tokens its sequences take, runtime/finishing.py decides where each ends, and the output
processor sends the events. Aborts are applied between steps, so pages never change hands
while the device writes to them.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .batch import Batch
from .executor import Executor
from .finishing import Stopping
from .generation_mode import GenerationMode, SearchDone, StepOutcome
from .invocation import InvocationError
from .kvcache.tiers import KvTiers
from .output_processor import OutputProcessor
from .request import Request, Sequence, SequenceState
from .sampling import SamplingParams
from .scheduler import BaseScheduler

if TYPE_CHECKING:
    from .decoding import DeviceSampling

log = logging.getLogger("kiln.batcher")


@dataclass
class BatcherCounters:
    steps: int = 0
    steps_by_phase: dict = field(default_factory=dict)  # "prefill", "decode", ... -> model calls
    prompt_tokens: int = 0
    generated_tokens: int = 0
    failed_batches: int = 0


class Batcher:
    def __init__(self, scheduler: BaseScheduler, executor: Executor, modes: list[GenerationMode],
                 stopping: Stopping, outputs: OutputProcessor, kv_tiers: KvTiers | None = None,
                 device_sampling: DeviceSampling | None = None):
        """`modes`: the generation modes, asked in order which takes a request (the last takes
        any). `kv_tiers`: the prefix cache's host (and disk) tiers: the host's copies are made
        before each step (and when idle) and passed on to be saved; with a disk, a request's
        saved pages are read before it is scheduled. `device_sampling`: which batches the compiled
        sampler chooses tokens for (an export with sample_bs<N>), None: the host samples all."""
        self.scheduler = scheduler
        self.executor = executor
        self.modes = {mode.name: mode for mode in modes}
        self._mode_order = list(modes)
        self._executors = {phase: ex for mode in modes for phase, ex in mode.executors().items()}
        self.stopping = stopping
        self.kv_tiers = kv_tiers
        self.device_sampling = device_sampling
        self._prefetching: set[asyncio.Task] = set()
        self.outputs = outputs
        self.counters = BatcherCounters()
        self.requests: dict[str, Request] = {}
        self._pending_aborts: set[str] = set()
        self._pending_resets: list[asyncio.Future] = []  # prefix-cache resets, each awaiting its count
        self._wake = asyncio.Event()
        self._stopping = False
        self._task: asyncio.Task | None = None

    # -- requests in and out ----------------------------------------------------------
    def submit(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        leader = None
        for index in range(request.params.sequence_count):
            seq = Sequence(request, index, leader=leader)
            request.sequences.append(seq)
            leader = leader or seq
        mode = self.mode_for(request.params)
        request.mode = mode.name
        mode.start(request)
        self.requests[request.request_id] = request
        self.stopping.add(request)
        self.outputs.add(request)
        self.counters.prompt_tokens += len(request.prompt_ids)
        if self.kv_tiers is None or self.kv_tiers.disk is None:
            self._schedule(request)
            return
        task = asyncio.get_running_loop().create_task(self._prefetch_then_schedule(request))
        self._prefetching.add(task)
        task.add_done_callback(self._prefetching.discard)

    def mode_for(self, params: SamplingParams) -> GenerationMode:
        """The mode that generates a request of these params: the first that accepts it."""
        return next(mode for mode in self._mode_order if mode.accepts(params))

    async def _prefetch_then_schedule(self, request: Request) -> None:
        try:
            await self.kv_tiers.read_prefix(request.cache_key(request.prompt_ids))
        except Exception:  # what could not be read is computed instead
            log.exception("reading a prompt's cached pages failed")
        self._schedule(request)

    def _schedule(self, request: Request) -> None:
        """Hand the request's sequences to the scheduler (those not aborted meanwhile)."""
        for seq in request.sequences:
            if seq.state is not SequenceState.FINISHED:
                self.scheduler.add(seq)
        self._wake.set()

    def wake(self) -> None:
        """Run the loop once more (it makes the host tier's waiting copies when idle)."""
        self._wake.set()

    def abort(self, request_id: str) -> None:
        """Stop a request; its pages come back before the next step."""
        if request_id in self.requests:
            self._pending_aborts.add(request_id)
            self._wake.set()

    def _apply_aborts(self) -> None:
        for request_id in self._pending_aborts:
            request = self.requests.get(request_id)
            if request is not None:
                self._end(request.sequences, "abort")
        self._pending_aborts.clear()

    def _end(self, seqs, reason: str, error: str | None = None, embedding=None) -> None:
        """Finish sequences from outside a step (abort, failure) or by their mode with no token
        to take (an embedding, given here): pages back, last event out.
        Each costs O(log n) at most, so a request of many sequences ends in one pass."""
        requests = {}
        for seq in seqs:
            if seq is None or seq.state is SequenceState.FINISHED:
                continue
            self.scheduler.finish(seq, reason)
            self.stopping.drop(seq)
            self.outputs.finish(seq, reason, error, embedding)
            requests[seq.request.request_id] = seq.request
        for request in requests.values():
            self._forget_if_done(request)

    def _forget_if_done(self, request: Request) -> None:
        if request.finished and self.requests.pop(request.request_id, None) is not None and request.on_done:
            request.on_done()

    async def reset_prefix_cache(self) -> int:
        """Drop every cached page no request uses (device and host tiers), between steps;
        returns how many went."""
        done = asyncio.get_running_loop().create_future()
        self._pending_resets.append(done)
        self._wake.set()
        return await done

    async def _apply_resets(self) -> None:
        if not self._pending_resets:
            return
        if self.kv_tiers is not None and self.kv_tiers.copies_pending:
            await self.copy_pages()  # no copy may still be bound for a slot the reset frees
        dropped = self.scheduler.cache.clear_unreferenced()
        for done in self._pending_resets:
            if not done.done():
                done.set_result(dropped)
        self._pending_resets.clear()

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
            try:
                await self._step()
            except Exception as error:  # a fault outside a model call must not leave requests waiting forever
                log.exception("a step failed outside its model call")
                self._fail_in_flight(f"internal error: {error}")
                await asyncio.sleep(0)  # the failed requests' handlers answer before the next step
        for done in self._pending_resets:  # stopped first: nothing was dropped
            if not done.done():
                done.set_result(0)

    async def _step(self) -> None:
        """Schedule one batch, run it and take its results (or wait for work)."""
        self._apply_aborts()
        await self._apply_resets()
        batch = self.scheduler.schedule()
        if batch is None and self.kv_tiers is not None and self.kv_tiers.copies_pending:
            await self.copy_pages()  # idle: make the copies now rather than before the next step
            return
        if batch is None:
            self._wake.clear()
            if not self._pending_aborts:
                await self._wake.wait()
            return
        for mode in self._mode_order:
            batch = await mode.prepare(batch)
        if self.device_sampling is not None:
            batch = self.device_sampling.plan(batch, self.scheduler.sequences_of(batch))
        if self.kv_tiers is not None and self.kv_tiers.copies_pending:
            # Pages restored for this batch must hold their K/V before it runs; pages evicted
            # while scheduling it are read before anyone writes them.
            await self.copy_pages()
        try:
            logits = await self._executors.get(batch.phase, self.executor).run(batch)
        except InvocationError as error:
            log.error("batch of %d failed: %s", batch.rows, error)
            self.counters.failed_batches += 1
            self._end(self.scheduler.sequences_of(batch), "error", str(error))
            return
        try:
            self.update(batch, logits)
        except Exception as error:  # never let one bad row stop every request
            log.exception("applying a step's results failed")
            self._end(self.scheduler.sequences_of(batch), "error", f"internal error: {error}")
        # Let request handlers run between steps even when the device is fast.
        await asyncio.sleep(0)

    def _fail_in_flight(self, error: str) -> None:
        """Every request in flight ends with `error`, and the prefix cache lets go of what it
        kept: after a fault in scheduling or a page copy, what the cache holds is not to be trusted."""
        self.counters.failed_batches += 1
        try:
            self._end([seq for request in list(self.requests.values()) for seq in request.sequences], "error", error)
            self.scheduler.cache.clear_unreferenced()
        except Exception:
            log.exception("ending the requests in flight failed as well: their last events are sent as they stand")
            for request in list(self.requests.values()):
                for seq in request.sequences:
                    if seq.state is not SequenceState.FINISHED:
                        seq.state = SequenceState.FINISHED
                        self.outputs.finish(seq, "error", error)
                self._forget_if_done(request)

    async def copy_pages(self) -> None:
        """The host tier's waiting copies, made between steps; then what went to the host is
        saved on disk."""
        await self.kv_tiers.flush(self.executor.copy_pages)

    # -- after a step -----------------------------------------------------------------
    def update(self, batch: Batch, logits: list[np.ndarray | None]) -> None:
        """Count the step's K/V, let each row's mode read its output, and take what it gives."""
        counters = self.counters
        counters.steps += 1
        counters.steps_by_phase[batch.phase.value] = counters.steps_by_phase.get(batch.phase.value, 0) + 1
        seqs = self.scheduler.sequences_of(batch)
        self.scheduler.written(batch)
        self.outputs.record_prompt_logprobs(batch, seqs, logits)
        rows_by_mode: dict[str, list[int]] = {}
        for i, seq in enumerate(seqs):
            if seq is not None:
                rows_by_mode.setdefault(seq.request.mode, []).append(i)
        for name, rows in rows_by_mode.items():
            mode = self.modes[name]
            for outcome in mode.update(batch, rows, seqs, logits):
                self._apply(outcome, mode)

    def _apply(self, outcome: StepOutcome, mode: GenerationMode) -> None:
        if isinstance(outcome, SearchDone):
            self._search_done(outcome)
            return
        seq = outcome.seq
        if seq.state is SequenceState.FINISHED:
            return
        if not outcome.samples and outcome.end is not None:  # its mode ends it with no token to take
            self._end([seq], outcome.end.reason, embedding=outcome.embedding)
            return
        for index, sample in enumerate(outcome.samples):
            mode_end = outcome.end if index == len(outcome.samples) - 1 else None
            taken = self.stopping.take(seq, sample.token_id, mode_end, mode.counts_max_tokens)
            self.counters.generated_tokens += 1
            self.outputs.token(seq, sample, taken)
            if taken.finish is not None:
                self.scheduler.finish(seq, taken.finish.reason)
                break
        self._forget_if_done(seq.request)

    def _search_done(self, done: SearchDone) -> None:
        """A search's sequences end together, its results sent whole."""
        request = done.request
        self.outputs.search_finished(request, done.results)
        self.counters.generated_tokens += sum(len(result.tokens) for result in done.results)
        for seq in request.sequences:
            self.scheduler.finish(seq, "stop")
            self.stopping.drop(seq)
        self._forget_if_done(request)
