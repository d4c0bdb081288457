"""Decides what runs next: a prefill batch or a decode batch. Executes nothing.

Continuous batching: sequences join (admitted when pages allow) and leave
(finished, aborted) between steps. Prefill and decode alternate while both have
work, and long prompts are cut into chunks, so a new prompt waits at most one
step and running sequences keep decoding while it is prefilled. When pages run
out the youngest sequence is preempted: its pages go back (its full pages stay
in the prefix cache) and it is recomputed when it is admitted again.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from .kvcache.base import BasePagedAttentionCache
from .request import Sequence, SequenceStatus


@dataclass
class Batch:
    kind: str  # "prefill" | "decode"
    batch_size: int  # the exported function's N (rows past len(seqs) are padding)
    seqs: list[Sequence]
    starts: list[int]  # position of each row's first token
    chunks: list[list[int]]  # the tokens each row feeds
    # Rows whose logits are sampled: a prefill chunk that completes a fresh prompt, every decode row.
    samples: list[bool] = field(default_factory=list)
    # Prefill rows that need the logits at every position of their chunk (prompt logprobs).
    full_logits: list[bool] = field(default_factory=list)


@dataclass
class SchedulerConfig:
    prefill_batch_sizes: list[int]
    decode_batch_sizes: list[int]
    block_seq_stride: int
    max_seq_len: int
    chunk_tokens: int = 256  # longest prefill chunk per sequence (a multiple of the stride)
    # While sequences wait to decode, the most prompt tokens one prefill call takes (0: no
    # cap): a prefill call is the gap between two streamed tokens of every running request.
    prefill_token_budget: int = 0
    max_running: int = 32  # sequences holding pages at once
    has_prefill_position: bool = True


def smallest_fitting(sizes: list[int], count: int) -> int:
    return next(size for size in sizes if size >= count)


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: BasePagedAttentionCache):
        self.config = config
        self.cache = cache
        self.waiting: list[tuple[tuple, Sequence]] = []  # heap by priority, then arrival
        self.running: list[Sequence] = []
        self.last_kind = "decode"
        self.preemptions = 0
        self._served = 0  # stamps decode service order, for round-robin
        if not config.has_prefill_position:
            # No start positions: whole prompts only, whatever the budget.
            self.config.chunk_tokens = config.max_seq_len
            self.config.prefill_token_budget = 0

    # -- membership -------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        heapq.heappush(self.waiting, (seq.priority_key, seq))

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take a sequence out wherever it is and give its pages back (publishing them first)."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._release(seq)
        else:
            self.waiting = [(k, s) for k, s in self.waiting if s is not seq]
            heapq.heapify(self.waiting)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def waiting_count(self) -> int:
        return len(self.waiting)

    # -- the decision -----------------------------------------------------------------
    def schedule(self) -> Batch | None:
        self._admit()
        prefilling = [s for s in self.running if s.in_prefill]
        decoding = [s for s in self.running if not s.in_prefill]
        if prefilling and (not decoding or self.last_kind == "decode"):
            batch = self._prefill_batch(prefilling, budgeted=bool(decoding))
        elif decoding:
            batch = self._decode_batch(decoding)
            if batch is None and prefilling:
                batch = self._prefill_batch(prefilling, budgeted=False)  # nothing can decode now
        else:
            batch = None
        if batch is not None:
            self.last_kind = batch.kind
        return batch

    def _admit(self) -> None:
        """Move waiting sequences to running, in priority order, while pages allow."""
        max_prefill = self.config.prefill_batch_sizes[-1]
        deferred = []
        while self.waiting and len(self.running) < self.config.max_running:
            if sum(1 for s in self.running if s.in_prefill) >= max_prefill:
                break
            key, seq = heapq.heappop(self.waiting)
            if not seq.can_start():
                deferred.append((key, seq))
                continue
            target = seq.prefill_target
            # Prompt logprobs need every prompt position computed: match no cached prefix.
            matchable = [] if seq.wants_prompt_logprobs else seq.tokens[:target]
            allocation = self.cache.acquire_pages_for_tokens(
                matchable, extra_token_slots=len(seq.tokens) - len(matchable)
            )
            if allocation is None:
                deferred.append((key, seq))
                break  # keep priority order: nothing younger jumps the queue
            seq.allocation = allocation
            seq.computed = allocation.cached_tokens
            if seq.index == 0 and not seq.preemptions:
                seq.request.cached_tokens = allocation.cached_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        for item in deferred:
            heapq.heappush(self.waiting, item)

    def _prefill_batch(self, candidates: list[Sequence], budgeted: bool) -> Batch:
        # As many rows as the largest exported size that they fill: prefill is compute-bound
        # and a padding row costs as much as a real one, so two prompts with sizes [1, 4] run
        # as two batches of 1 rather than one batch of 4 that is half padding.
        sizes = self.config.prefill_batch_sizes
        rows = max((size for size in sizes if size <= len(candidates)), default=sizes[0])
        candidates = sorted(candidates, key=lambda s: s.priority_key)[:rows]
        chunk_tokens = self.config.chunk_tokens
        if budgeted and self.config.prefill_token_budget:
            # Shorter chunks, whole pages each, so the call fits the budget.
            stride = self.config.block_seq_stride
            share = self.config.prefill_token_budget // len(candidates) // stride * stride
            chunk_tokens = min(chunk_tokens, max(stride, share))
        starts, chunks, samples = [], [], []
        for seq in candidates:
            end = min(seq.prefill_target, seq.computed + chunk_tokens)
            starts.append(seq.computed)
            chunks.append(seq.tokens[seq.computed : end])
            # A preempted sequence already sampled its last token: nothing to sample here.
            samples.append(end == seq.prefill_target and end == len(seq.tokens))
        size = smallest_fitting(self.config.prefill_batch_sizes, len(candidates))
        full_logits = [seq.wants_prompt_logprobs for seq in candidates]
        return Batch("prefill", size, candidates, starts, chunks, samples, full_logits)

    def _decode_batch(self, candidates: list[Sequence]) -> Batch | None:
        # Least recently served first: more sequences than the largest batch take turns.
        candidates = sorted(candidates, key=lambda s: s.last_served)
        chosen: list[Sequence] = []
        for seq in candidates:
            if len(chosen) == self.config.decode_batch_sizes[-1]:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted to make room for an earlier one
            if self._ensure_pages(seq, exclude=chosen):
                chosen.append(seq)
        for seq in chosen:
            self._served += 1
            seq.last_served = self._served
        if not chosen:
            return None
        size = smallest_fitting(self.config.decode_batch_sizes, len(chosen))
        starts = [len(s.tokens) - 1 for s in chosen]
        chunks = [[s.tokens[-1]] for s in chosen]
        return Batch("decode", size, chosen, starts, chunks, [True] * len(chosen))

    # -- pages ------------------------------------------------------------------------
    def _ensure_pages(self, seq: Sequence, exclude: list[Sequence]) -> bool:
        """Pages for seq's next token, preempting younger sequences if the pool is dry."""
        while not self.cache.extend_allocation(seq.allocation, len(seq.tokens)):
            victim = max(
                (s for s in self.running if s not in exclude),
                key=lambda s: (s.request.priority, s.order),
                default=None,
            )
            if victim is None:
                return False
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def preempt(self, seq: Sequence) -> None:
        """Give back seq's pages and queue it to be recomputed from its tokens."""
        self.running.remove(seq)
        self._release(seq)
        seq.computed = 0
        seq.preemptions += 1
        self.preemptions += 1
        self.add(seq)

    def _release(self, seq: Sequence) -> None:
        if seq.allocation is not None:
            self.cache.publish_allocated_pages(seq.allocation, seq.tokens[: seq.computed])
            self.cache.free_cache_pages(seq.allocation)
            seq.allocation = None

    def publish(self, seq: Sequence) -> None:
        if seq.allocation is not None:
            self.cache.publish_allocated_pages(seq.allocation, seq.tokens[: seq.computed])
