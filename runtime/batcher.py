"""The batcher: one asyncio task that steps the model for every request in flight.

Each step is three calls, as in nano-vllm: the scheduler decides a batch, the
executor runs it, and the step's results are applied: sampled by the sampler,
taken in by the scheduler (the one owner of sequence states), and turned into text
and events by the output processor. A diffusion LM's pass is applied by its scheduler,
whose newly committed tokens go out the same way. Aborts are applied between steps, so
pages never change hands while the device writes to them.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import numpy as np

from .batch import Batch, Phase
from .beam_search import BeamGroup
from .executor import Executor
from .invocation import InvocationError
from .kv_tiers import KvTiers
from .output_processor import OutputProcessor
from .request import Request, Sequence, SequenceState
from .sampling import SampleResult, Sampler
from .scheduler import Scheduler
from .speculative import Speculator

log = logging.getLogger("kiln.batcher")


@dataclass
class BatcherCounters:
    steps: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    denoise_steps: int = 0
    verify_steps: int = 0  # APD's verifier calls
    speculate_steps: int = 0  # speculative decoding's verify calls (decode steps with drafts)
    # A diffusion LM's passes by what they computed ("full", "prefix", "dual", "apd"), and how many
    # passes committed each number of positions (the tokens-per-forward histogram).
    forward_passes: dict = field(default_factory=dict)
    committed_per_pass: dict = field(default_factory=dict)
    prompt_tokens: int = 0
    generated_tokens: int = 0
    failed_batches: int = 0


class Batcher:
    def __init__(self, scheduler: Scheduler, executor: Executor, outputs: OutputProcessor, sampler: Sampler,
                 verifier: Executor | None = None, speculator: Speculator | None = None,
                 kv_tiers: KvTiers | None = None):
        """`verifier`, with APD: the autoregressive model that runs the scheduler's VERIFY batches.
        `speculator`, with speculative decoding: drafts for decode batches, and what rows keep.
        `kv_tiers`: the prefix cache's host (and disk) tiers: the host's copies are made before
        each step (and when idle) and passed on to be saved; with a disk, a request's saved pages
        are read before it is scheduled."""
        self.scheduler = scheduler
        self.executor = executor
        self.verifier = verifier
        self.speculator = speculator
        self.kv_tiers = kv_tiers
        self.host_tier = kv_tiers.host if kv_tiers is not None else None
        self._prefetching: set[asyncio.Task] = set()
        self.outputs = outputs
        self.sampler = sampler
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
        if request.params.beam_search:
            request.beams = BeamGroup(request.params.num_beams, request.params.length_penalty)
        leader = None
        for index in range(request.params.sequence_count):
            seq = Sequence(request, index, leader=leader)
            request.sequences.append(seq)
            leader = leader or seq
        self.requests[request.request_id] = request
        self.outputs.add(request)
        self.counters.prompt_tokens += len(request.prompt_ids)
        if self.kv_tiers is None or self.kv_tiers.disk is None:
            self._schedule(request)
            return
        task = asyncio.get_running_loop().create_task(self._prefetch_then_schedule(request))
        self._prefetching.add(task)
        task.add_done_callback(self._prefetching.discard)

    async def _prefetch_then_schedule(self, request: Request) -> None:
        try:
            await self.kv_tiers.read_prefix(request.prompt_ids)
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

    def _end(self, seqs, reason: str, error: str | None = None) -> None:
        """Finish sequences from outside a step (abort, failure): pages back, last event out.
        Each costs O(log n) at most, so a request of many sequences ends in one pass."""
        requests = {}
        for seq in seqs:
            if seq is None or seq.state is SequenceState.FINISHED:
                continue
            self.scheduler.finish(seq, reason)
            self.outputs.finish(seq, reason, error)
            requests[seq.request.request_id] = seq.request
        for request in requests.values():
            self._forget_if_done(request)

    def _forget_if_done(self, request: Request) -> None:
        if request.finished:
            self.requests.pop(request.request_id, None)

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
            if batch is None and self.host_tier is not None and self.host_tier.pending:
                await self.copy_pages()  # idle: make the copies now rather than before the next step
                continue
            if batch is None:
                self._wake.clear()
                if not self._pending_aborts:
                    await self._wake.wait()
                continue
            if self.speculator is not None and batch.phase is Phase.DECODE:
                batch = await self.speculator.extend(batch)
            if self.host_tier is not None and self.host_tier.pending:
                # Pages restored for this batch must hold their K/V before it runs; pages evicted
                # while scheduling it are read before anyone writes them.
                await self.copy_pages()
            try:
                executor = self.verifier if batch.phase is Phase.VERIFY else self.executor
                logits = await executor.run(batch)
            except InvocationError as error:
                log.error("batch of %d failed: %s", batch.rows, error)
                self.counters.failed_batches += 1
                self._end(self.scheduler.sequences_of(batch), "error", str(error))
                continue
            try:
                self.postprocess(batch, logits)
            except Exception as error:  # never let one bad row stop every request
                log.exception("postprocess failed")
                self._end(self.scheduler.sequences_of(batch), "error", f"internal error: {error}")
            # Let request handlers run between steps even when the device is fast.
            await asyncio.sleep(0)

    async def copy_pages(self) -> None:
        """The host tier's waiting copies, made between steps; then what went to the host is
        passed on (to be saved on disk)."""
        if not self.host_tier.pending:
            return
        copied = await self.executor.copy_pages(self.host_tier)
        self.kv_tiers.save_copies(copied)

    # -- after a step -----------------------------------------------------------------
    def postprocess(self, batch: Batch, logits: list[np.ndarray | None]) -> None:
        """Sample, let the scheduler apply the step, and send each sequence's new text."""
        self.counters.steps += 1
        if batch.phase in (Phase.DENOISE, Phase.VERIFY):
            if batch.phase is Phase.DENOISE:
                self.counters.denoise_steps += 1
            else:
                self.counters.verify_steps += 1
            self._apply_denoise(batch, logits)
            return
        if batch.phase is Phase.SPECULATE:
            self.counters.speculate_steps += 1
            self._apply_speculation(batch, logits)
            return
        if batch.phase is Phase.PREFILL:
            self.counters.prefill_steps += 1
        else:
            self.counters.decode_steps += 1
        seqs = self.scheduler.sequences_of(batch)
        last_logits: list[np.ndarray | None] = []
        for seq, start, full, row_logits in zip(seqs, batch.starts, batch.full_logits, logits):
            if seq is not None and full and row_logits is not None:  # every position: prompt logprobs
                self.outputs.record_prompt_logprobs(seq, start, row_logits)
                row_logits = row_logits[-1]
            last_logits.append(row_logits)
        sampling = [i for i, (seq, samples) in enumerate(zip(seqs, batch.samples)) if seq is not None and samples]
        beam_rows = [i for i in sampling if seqs[i].request.beams is not None]  # scored by the group, not sampled
        sampling = [i for i in sampling if seqs[i].request.beams is None]
        samples = dict(zip(sampling, self.sampler.sample_rows([last_logits[i] for i in sampling],
                                                              [seqs[i] for i in sampling])))
        tokens = [samples[i].token_id if i in samples else None for i in range(batch.rows)]
        finishes = self.scheduler.postprocess(batch, tokens)
        self.counters.generated_tokens += len(samples)
        for i, sample in samples.items():
            seq = seqs[i]
            if self.outputs.token(seq, sample, finishes[i]):
                self.scheduler.finish(seq, "stop")
            self._forget_if_done(seq.request)
        for i in beam_rows:
            self._beam_report(seqs[i], last_logits[i])

    def _beam_report(self, seq: Sequence, logits: np.ndarray) -> None:
        """A beam's next-token logits; once every live beam of its search has reported, the
        search steps: beams continue or fork, and a finished search sends its best beams."""
        request = seq.request
        group = request.beams
        if not group.report(seq.index, logits):
            return
        params = request.params
        ends = frozenset(self.scheduler.eos_token_ids if not params.ignore_eos else ()) | set(params.stop_token_ids)
        generated = [s.output_ids for s in request.sequences[: group.live]]
        choices = group.step(generated, ends, params.max_tokens)
        self.counters.generated_tokens += len(generated)
        self.scheduler.apply_beams(request, choices)
        if group.done:
            self.outputs.beams_finished(request, group.ranked(params.n))
            for beam in request.sequences:
                self.scheduler.finish(beam, "stop")
            self._forget_if_done(request)

    def _apply_speculation(self, batch: Batch, logits: list[np.ndarray | None]) -> None:
        """A verify call: each row's kept tokens go out one by one, as if decoded one per step."""
        seqs = self.scheduler.sequences_of(batch)
        kept = self.speculator.verify(batch, seqs, logits, self.sampler)
        finishes = self.scheduler.postprocess_speculative(batch, [[r.token_id for r in row] for row in kept])
        for seq, samples, row_finishes in zip(seqs, kept, finishes):
            for sample, finish in zip(samples, row_finishes):
                self.counters.generated_tokens += 1
                if self.outputs.token(seq, sample, finish):
                    self.scheduler.finish(seq, "stop")
                    break
            if seq is not None:
                self._forget_if_done(seq.request)

    def _apply_denoise(self, batch: Batch, logits: list[np.ndarray | None]) -> None:
        """A diffusion LM's pass: the scheduler commits each canvas; the newly committed
        tokens go out as text, left to right, as if sampled one by one."""
        for update in self.scheduler.postprocess(batch, logits):
            seq, counters = update.seq, self.counters
            kind, committed = seq.canvas.last_pass_kind, seq.canvas.committed_per_pass[-1]
            counters.forward_passes[kind] = counters.forward_passes.get(kind, 0) + 1
            counters.committed_per_pass[committed] = counters.committed_per_pass.get(committed, 0) + 1
            counters.generated_tokens += len(update.tokens)
            for index, token in enumerate(update.tokens):
                finish = update.finish if index == len(update.tokens) - 1 else None
                if self.outputs.token(seq, SampleResult(token), finish):
                    self.scheduler.finish(seq, "stop")
                    break
            else:
                if update.finish is not None and not update.tokens:
                    self.outputs.finish(seq, update.finish.reason)
            self._forget_if_done(seq.request)
