"""Decides what runs next and owns every change of a sequence's state. Executes nothing.

Continuous batching: sequences join (admitted when pages allow) and leave (finished,
aborted) between steps. Prefill and decode alternate while both have work, and long
prompts are cut into chunks, so a new prompt waits at most one step and running
sequences keep decoding while it is prefilled. When pages run out the youngest
sequence is preempted: its pages go back (its full pages stay in the prefix cache)
and it is recomputed when it is admitted again.

After a step, `written` counts the K/V the step wrote (and publishes a prompt's full
pages); the tokens a step gives each sequence are its generation mode's to read, and
whether a sequence ends is runtime/finishing.py's to decide: the scheduler then takes it
out (`finish`). Sequences that decode together (a beam search's) are scheduled as one gang,
all of them or none.
"""

from __future__ import annotations

from dataclasses import dataclass

from .batch import Batch, Phase
from .kvcache.base import BasePagedAttentionCache
from .request import Sequence, SequenceState
from .waiting_queue import WaitingQueue


@dataclass(frozen=True)
class SchedulerConfig:
    prefill_batch_sizes: tuple[int, ...]  # ascending, as exported
    decode_batch_sizes: tuple[int, ...]
    block_seq_stride: int
    max_seq_len: int
    chunk_tokens: int  # longest prefill chunk per sequence
    # While sequences wait to decode, the most prompt tokens one prefill call takes (0: no
    # cap): a prefill call is the gap between two streamed tokens of every running request.
    prefill_token_budget: int
    max_running: int  # sequences holding pages at once
    has_prefill_position: bool  # without start positions a prompt is prefilled whole, in one call

    @property
    def chunk(self) -> int:
        """The prefill chunk: whole pages, or whole prompts where prefill takes no start position."""
        if not self.has_prefill_position:
            return self.max_seq_len
        return max(self.block_seq_stride, self.chunk_tokens // self.block_seq_stride * self.block_seq_stride)

    @property
    def budget(self) -> int:
        """The prefill token budget while others decode; 0 (none) for whole-prompt exports."""
        return self.prefill_token_budget if self.has_prefill_position else 0


def _shared_pages(a: list[int], b: list[int], most: int, stride: int) -> int:
    """How many whole pages (up to `most`) two token lists start with in common."""
    pages = 0
    while pages < most and a[pages * stride : (pages + 1) * stride] == b[pages * stride : (pages + 1) * stride] \
            and len(b) >= (pages + 1) * stride:
        pages += 1
    return pages


def smallest_fitting(sizes: tuple[int, ...], count: int) -> int:
    return next(size for size in sizes if size >= count)


class BaseScheduler:
    """What every scheduler shares: the waiting queue (by priority, then arrival), the
    sequences holding pages, and taking a sequence out wherever it is."""

    def __init__(self, cache: BasePagedAttentionCache):
        self.cache = cache
        self.waiting = WaitingQueue()
        self.running: list[Sequence] = []  # holding pages
        self._running_by_id: dict[int, Sequence] = {}
        self.preemptions = 0
        self._served = 0  # stamps service order, for round-robin

    # -- membership -------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.state = SequenceState.WAITING
        self.waiting.push(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take a sequence out wherever it is and give its pages back (publishing them first)."""
        if seq.state is SequenceState.FINISHED:
            return
        if seq.state.holds_pages:
            self._stop_running(seq)
        else:
            self.waiting.remove(seq)
        seq.state = SequenceState.FINISHED
        seq.finish_reason = reason

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def waiting_count(self) -> int:
        return len(self.waiting)

    def sequences_of(self, batch: Batch) -> list[Sequence | None]:
        """Each row's sequence, or None where it finished (was aborted) since the batch was made."""
        return [self._running_by_id.get(seq_id) for seq_id in batch.seq_ids]

    def _start_running(self, seq: Sequence, state: SequenceState) -> None:
        seq.state = state
        self.running.append(seq)
        self._running_by_id[seq.seq_id] = seq

    def _stop_running(self, seq: Sequence) -> None:
        self.running.remove(seq)
        del self._running_by_id[seq.seq_id]
        if seq.allocation is not None:
            self.publish(seq)
            self.cache.free_cache_pages(seq.allocation)
            seq.allocation = None

    def publish(self, seq: Sequence) -> None:
        """Offer seq's full pages of computed tokens to the prefix cache (others may share them)."""
        if seq.allocation is not None:
            self.cache.publish_allocated_pages(seq.allocation, seq.request.cache_key(seq.tokens[: seq.computed]))

    def written(self, batch: Batch) -> None:
        """A batch has run: its rows' K/V are in the cache (a prompt's full pages published), and
        a sequence whose prompt is all written decodes from now on."""
        for seq, start, chunk in zip(self.sequences_of(batch), batch.starts, batch.tokens):
            if seq is None:  # finished (aborted) while the batch ran
                continue
            seq.computed += len(chunk)
            if batch.phase in (Phase.PREFILL, Phase.EMBED):
                self.publish(seq)
            if seq.allocation is not None:
                # A draft's tokens may yet be rejected (Sequence.append): its window moves only past
                # the token certain to stay.
                certain = start + 1 if batch.phase is Phase.SPECULATE else seq.computed
                self.cache.advance(seq.allocation, certain)
            if seq.state is SequenceState.PREFILL and seq.computed >= seq.prefill_target:
                seq.state = SequenceState.DECODE


class Scheduler(BaseScheduler):
    def __init__(self, config: SchedulerConfig, cache: BasePagedAttentionCache):
        super().__init__(cache)
        self.config = config
        self.last_phase = Phase.DECODE

    # -- the decision -----------------------------------------------------------------
    def schedule(self) -> Batch | None:
        batch = self._schedule_once()
        while batch is None and self.waiting and self._preempt_a_stalled_gang():
            batch = self._schedule_once()
        return batch

    def _preempt_a_stalled_gang(self) -> bool:
        """Nothing can run: gangs (sequences that step together) each hold some members' pages and
        wait for pages for the rest. The youngest such gang gives its pages back; True if one did."""
        stalled = [s for s in self.running
                   if any(not member.state.holds_pages for member in s.request.mode_state.gang(s))]
        if not stalled:
            return False
        youngest = max(stalled, key=lambda s: (s.request.priority, s.seq_id))
        for member in youngest.request.mode_state.gang(youngest):
            if member.state.holds_pages:
                self.preempt(member)
        return True

    def _schedule_once(self) -> Batch | None:
        self._admit()
        prefilling = [s for s in self.running if s.state is SequenceState.PREFILL]
        decoding = [s for s in self.running if s.state is SequenceState.DECODE]
        if prefilling and (not decoding or self.last_phase is Phase.DECODE):
            batch = self._prefill_batch(prefilling, budgeted=bool(decoding))
            if batch is None and decoding:  # no prompt could have its chunk's pages now
                batch = self._decode_batch(decoding)
        elif decoding:
            batch = self._decode_batch(decoding)
            if batch is None and prefilling:
                batch = self._prefill_batch(prefilling, budgeted=False)  # nothing can decode now
        else:
            batch = None
        if batch is not None:
            self.last_phase = batch.phase
        return batch

    def _admit(self) -> None:
        """Move waiting sequences to PREFILL, in priority order, while pages allow."""
        max_prefill = self.config.prefill_batch_sizes[-1]
        deferred = []
        while self.waiting and len(self.running) < self.config.max_running:
            if sum(1 for s in self.running if s.state is SequenceState.PREFILL) >= max_prefill:
                break
            seq = self.waiting.pop()
            if not seq.can_start() or self._prefix_in_flight(seq):
                deferred.append(seq)
                continue
            target = seq.prefill_target
            # Prompt logprobs (and mean or CLS pooling) need every prompt position computed:
            # match no cached prefix.
            matchable = [] if seq.computes_whole_prompt else seq.request.cache_key(seq.tokens[:target])
            allocation = self.cache.acquire_pages_for_tokens(
                matchable, extra_token_slots=len(seq.tokens) - len(matchable)
            )
            if allocation is None:
                deferred.append(seq)
                break  # keep priority order: nothing younger jumps the queue
            seq.allocation = allocation
            seq.computed = allocation.cached_tokens
            if seq.index == 0 and not seq.preemptions:
                seq.request.cached_tokens = allocation.cached_tokens
            self._start_running(seq, SequenceState.PREFILL)
            seq.request.mark_scheduled()
        for seq in deferred:
            self.waiting.push(seq)

    def _prefix_in_flight(self, seq: Sequence) -> bool:
        """Whether a sequence being prefilled is about to publish pages of seq's prompt that the
        cache does not hold yet: seq waits for them rather than computing them a second time (two
        requests with one long system prompt, arriving together, compute it once)."""
        if not self.cache.shares_prefixes or seq.computes_whole_prompt:
            return False
        stride = self.config.block_seq_stride
        matchable = (seq.prefill_target - 1) // stride * stride  # the cache leaves the last token to compute
        for other in self.running:
            if (other.state is not SequenceState.PREFILL or other.computed >= matchable
                    or other.request.cache_salt != seq.request.cache_salt):  # another adapter's K/V
                continue
            shared = _shared_pages(seq.tokens, other.tokens, matchable // stride, stride) * stride
            if shared > other.computed:
                return True
        return False

    def _prefill_batch(self, candidates: list[Sequence], budgeted: bool) -> Batch | None:
        # As many rows as the largest exported size that they fill: prefill is compute-bound
        # and a padding row costs as much as a real one, so two prompts with sizes [1, 4] run
        # as two batches of 1 rather than one batch of 4 that is half padding.
        # Prompts for embeddings run through embed_bs<N>, the others through prefill: one kind a
        # call, the first in priority order's.
        candidates = sorted(candidates, key=lambda s: s.priority_key)
        phase = candidates[0].prefill_phase
        candidates = [seq for seq in candidates if seq.prefill_phase is phase]
        sizes = self.config.prefill_batch_sizes
        rows = max((size for size in sizes if size <= len(candidates)), default=sizes[0])
        candidates = candidates[:rows]
        chunk_tokens = self.config.chunk
        if budgeted and self.config.budget:
            # Shorter chunks, whole pages each, so the call fits the budget.
            stride = self.config.block_seq_stride
            share = self.config.budget // len(candidates) // stride * stride
            chunk_tokens = min(chunk_tokens, max(stride, share))
        starts, chunks, samples, kept = [], [], [], []
        for seq in candidates:
            if not seq.state.holds_pages:
                continue  # preempted to make room for an earlier one
            end = min(seq.prefill_target, seq.computed + chunk_tokens)
            # The chunk's pages: a window pool (kvcache/window_pool.py) gives sliding layers' pages as
            # their blocks are about to be written; any other pool's are there since admission.
            if not self._ensure_pages(seq, exclude=kept, tokens=end):
                continue
            kept.append(seq)
            starts.append(seq.computed)
            chunks.append(tuple(seq.tokens[seq.computed : end]))
            # A preempted sequence already sampled its last token: nothing to sample here.
            samples.append(end == seq.prefill_target and end == len(seq.tokens))
        if not kept:
            return None
        full_logits = tuple(seq.computes_whole_prompt for seq in kept)
        return self._batch(phase, smallest_fitting(sizes, len(kept)), kept, starts, chunks, samples, full_logits)

    def _decode_batch(self, candidates: list[Sequence]) -> Batch | None:
        # Least recently served first: more sequences than the largest batch take turns.
        candidates = sorted(candidates, key=lambda s: s.last_served)
        chosen: list[Sequence] = []
        largest = self.config.decode_batch_sizes[-1]
        for seq in candidates:
            if len(chosen) == largest:
                break
            if seq.state is not SequenceState.DECODE or seq in chosen:
                continue  # preempted to make room for an earlier one, or taken with its gang
            gang = seq.request.mode_state.gang(seq)
            if len(gang) > 1:
                chosen += self._gang_to_decode(gang, chosen, largest)
            elif self._ensure_pages(seq, exclude=chosen):
                chosen.append(seq)
        if not chosen:
            return None
        for seq in chosen:
            self._served += 1
            seq.last_served = self._served
        size = smallest_fitting(self.config.decode_batch_sizes, len(chosen))
        starts = [len(s.tokens) - 1 for s in chosen]
        chunks = [(s.tokens[-1],) for s in chosen]
        return self._batch(Phase.DECODE, size, chosen, starts, chunks, [True] * len(chosen), (False,) * len(chosen))

    def speculative_batch(self, batch: Batch, drafts: list[list[int]]) -> Batch:
        """A decode batch with each row's draft after its last token: one decode call with a row
        per token (runtime/invocation.py), whose logits check the drafts. Drafts are cut to what
        the sequence may still generate, to the rows the widest decode has left, and to the pages
        the pool can spare without preempting anyone; where no row keeps a draft, the decode
        batch itself."""
        seqs = self.sequences_of(batch)
        spare = self.config.decode_batch_sizes[-1] - len(seqs)  # call rows left once each feeds its last token
        kept = []
        for left, (seq, draft) in zip(range(len(seqs), 0, -1), zip(seqs, drafts)):
            room = min(seq.params.max_tokens - seq.generated, self.config.max_seq_len - len(seq.tokens)) - 1
            share = spare // left  # an even share of the rows left: what a row leaves, the next may take
            draft = list(draft[: max(min(room, share), 0)])
            if draft and not self.cache.extend_allocation(seq.allocation, len(seq.tokens) + len(draft)):
                draft = []
            spare -= len(draft)
            kept.append(draft)
        if not any(kept):
            return batch
        chunks = [(seq.tokens[-1], *draft) for seq, draft in zip(seqs, kept)]
        size = smallest_fitting(self.config.decode_batch_sizes, sum(map(len, chunks)))
        return self._batch(Phase.SPECULATE, size, seqs, batch.starts, chunks, batch.samples, (True,) * len(seqs))

    def _gang_to_decode(self, gang: list[Sequence], chosen: list[Sequence], largest: int) -> list[Sequence]:
        """A gang's sequences, all of them or none: they step together, so they decode only once
        every one is decoding (a forked beam first prefills its parent's last page)."""
        if any(s.state is not SequenceState.DECODE for s in gang) or len(chosen) + len(gang) > largest:
            return []
        if all(self._ensure_pages(s, exclude=chosen + gang) for s in gang):
            return gang
        return []

    @staticmethod
    def _batch(phase, size, seqs, starts, chunks, samples, full_logits) -> Batch:
        return Batch(phase, size, tuple(s.seq_id for s in seqs), tuple(starts), tuple(chunks),
                     tuple(tuple(s.allocation.pages) for s in seqs), tuple(samples), tuple(full_logits),
                     lora_slots=tuple(s.request.lora_slot for s in seqs))

    # -- pages ------------------------------------------------------------------------
    def _ensure_pages(self, seq: Sequence, exclude: list[Sequence], tokens: int | None = None) -> bool:
        """Pages for seq's first `tokens` (default: up to its next token), preempting younger
        sequences if the pool is dry."""
        while not self.cache.extend_allocation(seq.allocation, len(seq.tokens) if tokens is None else tokens):
            victim = max(
                (s for s in self.running if s not in exclude),
                key=lambda s: (s.request.priority, s.seq_id),
                default=None,
            )
            if victim is None:
                return False
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def restart_from(self, seq: Sequence, tokens: list[int]) -> None:
        """seq continues from other tokens (a beam forked from another): its pages go back and
        it is recomputed, its prefix found in the cache where another published it."""
        if seq.state.holds_pages:
            self._stop_running(seq)
            self.add(seq)
        seq.tokens = tokens
        seq.computed = 0

    def preempt(self, seq: Sequence) -> None:
        """Give back seq's pages and queue it to be recomputed from its tokens."""
        self._stop_running(seq)
        seq.computed = 0
        seq.preemptions += 1
        self.preemptions += 1
        self.add(seq)
