"""Decides which diffusion sequences share the next `denoise` call (or, with APD, the
verifier's next call), and applies its results.

A diffusion sequence takes the pages for its whole sequence (prompt and canvas; twice
with classifier-free guidance) when it is admitted, so it never grows and is never
preempted: one that does not fit waits, in priority order, as an autoregressive one
does. Rows of one call must have the same width: windows that end where their
attention ends (whole-sequence passes) are padded to a common width of whole pages,
the others (a cached block) are grouped by exact width. Prefix sharing is off: a
diffusion prompt's K/V depend on the canvas after it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..batch import Batch, Phase
from ..kvcache.base import BasePagedAttentionCache
from ..request import Sequence, SequenceState
from ..scheduler import BaseScheduler, smallest_fitting
from .apd import ApdCanvas
from .canvas import Canvas, Window


@dataclass(frozen=True)
class DiffusionSchedulerConfig:
    denoise_batch_sizes: tuple[int, ...]  # ascending, as exported
    block_seq_stride: int
    max_running: int
    mask_token_id: int
    logits_shift: int
    has_denoise_top: bool = False  # greedy batches may read per-position summaries, not logits


@dataclass(frozen=True)
class DenoiseUpdate:
    """What one pass gave a sequence: tokens newly committed without a gap, and whether its
    canvas is now all committed."""

    seq: Sequence
    tokens: list[int]
    canvas_done: bool


class DiffusionScheduler(BaseScheduler):
    def __init__(self, config: DiffusionSchedulerConfig, cache: BasePagedAttentionCache,
                 verifier_cache: BasePagedAttentionCache | None = None, verifier_batch_sizes: tuple[int, ...] = ()):
        """`verifier_cache`, with APD: the pages of the autoregressive verifier's own cache."""
        super().__init__(cache)
        self.config = config
        self.verifier_cache = verifier_cache
        self.verifier_batch_sizes = verifier_batch_sizes
        self._guidance_pages = {}  # seq_id -> the allocation of its prompt-masked twin (cfg)
        self._verifier_pages = {}  # seq_id -> its allocation in the verifier's cache (APD)

    @staticmethod
    def rows_of(seq: Sequence) -> int:
        """Rows a sequence takes in a call: two with classifier-free guidance (its twin's prompt masked)."""
        return 2 if seq.params.diffusion.cfg_scale else 1

    # -- the decision -----------------------------------------------------------------
    def schedule(self) -> Batch | None:
        drafted = [s for s in self.running if s.mode_state.awaiting_verifier]
        if drafted:  # APD drafts are verified before anything else runs
            return self._verify_batch(drafted)
        self._admit()
        if not self.running:
            return None
        order = sorted(self.running, key=lambda s: (s.request.priority, s.last_served, s.seq_id))
        windows = {seq.seq_id: seq.mode_state.window() for seq in order}
        group = self._group_key(windows[order[0].seq_id])
        capacity = self.config.denoise_batch_sizes[-1]
        chosen: list[Sequence] = []
        rows = 0
        for seq in order:
            if self._group_key(windows[seq.seq_id]) == group and rows + self.rows_of(seq) <= capacity:
                chosen.append(seq)
                rows += self.rows_of(seq)
        seq_ids, starts, tokens, tables, visible = [], [], [], [], []
        for seq in chosen:
            self._served += 1
            seq.last_served = self._served
            window = windows[seq.seq_id]
            for row_tokens, allocation in ((window.tokens, seq.allocation),
                                           (window.unconditional, self._guidance_pages.get(seq.seq_id))):
                if row_tokens is None:
                    continue
                seq_ids.append(seq.seq_id)
                starts.append(window.start)
                tokens.append(tuple(int(t) for t in row_tokens))
                tables.append(tuple(allocation.pages))
                visible.append(window.visible)
        size = smallest_fitting(self.config.denoise_batch_sizes, len(seq_ids))
        logits = not self.config.has_denoise_top or any(seq.mode_state.needs_logits for seq in chosen)
        return Batch(Phase.DENOISE, size, tuple(seq_ids), tuple(starts), tuple(tokens), tuple(tables),
                     (True,) * len(seq_ids), (logits,) * len(seq_ids), tuple(visible))

    def _verify_batch(self, drafted: list[Sequence]) -> Batch:
        drafted = sorted(drafted, key=lambda s: (s.request.priority, s.seq_id))[: self.verifier_batch_sizes[-1]]
        windows = [seq.mode_state.verifier_window() for seq in drafted]
        size = smallest_fitting(self.verifier_batch_sizes, len(drafted))
        return Batch(Phase.VERIFY, size, tuple(s.seq_id for s in drafted), tuple(w.start for w in windows),
                     tuple(tuple(int(t) for t in w.tokens) for w in windows),
                     tuple(tuple(self._verifier_pages[s.seq_id].pages) for s in drafted),
                     (False,) * len(drafted), (True,) * len(drafted))

    def _group_key(self, window: Window) -> tuple:
        if window.start + window.width == window.visible:  # padding lands past its attention: pad to whole pages
            stride = self.config.block_seq_stride
            return ("padded", -(-window.width // stride) * stride)
        return ("exact", window.width)

    def _admit(self) -> None:
        """Move waiting sequences to DENOISE, in priority order, while pages allow."""
        while self.waiting and len(self.running) < self.config.max_running:
            seq = self.waiting.peek()
            plan = seq.params.diffusion.plan(seq.params.max_tokens)
            length = seq.prompt_len + plan.canvas_length
            main = self.cache.acquire_pages_for_tokens([], extra_token_slots=length)
            if main is None:
                return  # keep priority order: nothing younger jumps the queue
            second = None  # the guidance twin's pages, or the verifier's (APD)
            if self.rows_of(seq) == 2 or plan.params.apd:
                cache = self.verifier_cache if plan.params.apd else self.cache
                second = cache.acquire_pages_for_tokens([], extra_token_slots=length)
                if second is None:
                    self.cache.free_cache_pages(main)
                    return
                (self._verifier_pages if plan.params.apd else self._guidance_pages)[seq.seq_id] = second
            self.waiting.pop()
            seq.allocation = main
            if seq.mode_state is None:
                seq.mode_state = self._canvas(seq, plan)
            self._start_running(seq, SequenceState.DENOISE)
            seq.request.mark_scheduled()

    def _canvas(self, seq: Sequence, plan):
        config, params = self.config, plan.params
        if params.apd:
            return ApdCanvas(seq.prompt_ids, plan.canvas_length, config.mask_token_id, config.logits_shift,
                             seq.params.temperature, seq.rng, params.apd_mixture_weight, params.apd_kv_window,
                             params.apd_max_lookahead)
        return Canvas(seq.prompt_ids, plan, config.mask_token_id, config.logits_shift, seq.params.temperature, seq.rng)

    # -- after a step -----------------------------------------------------------------
    def written(self, batch: Batch) -> None:
        """Nothing to count: a canvas's K/V are rewritten by every pass, and never published."""

    def commit(self, batch: Batch, logits: list[np.ndarray]) -> list[DenoiseUpdate]:
        """Commit each sequence's pass; what it committed after its tokens without a gap is
        what it takes (runtime/finishing.py decides where it ends)."""
        rows: dict[int, list[np.ndarray]] = {}
        for seq_id, row_logits in zip(batch.seq_ids, logits):
            rows.setdefault(seq_id, []).append(row_logits)
        summarized = batch.phase is Phase.DENOISE and not any(batch.full_logits)
        updates = []
        for seq_id, (conditional, *unconditional) in rows.items():
            seq = self._running_by_id.get(seq_id)
            if seq is None:  # aborted while the batch ran
                continue
            canvas = seq.mode_state
            if batch.phase is Phase.VERIFY:
                canvas.accept(conditional)
            else:
                canvas.commit(conditional, unconditional[0] if unconditional else None, summarized)
                seq.request.forward_passes += 1
                if canvas.awaiting_verifier:
                    continue  # an APD draft: the verifier's pass decides what is committed
            new = canvas.tokens[seq.prompt_len + seq.generated : seq.prompt_len + canvas.committed_prefix()].tolist()
            updates.append(DenoiseUpdate(seq, new, canvas.done))
        return updates

    def _stop_running(self, seq: Sequence) -> None:
        twin = self._guidance_pages.pop(seq.seq_id, None)
        if twin is not None:
            self.cache.free_cache_pages(twin)
        verifier = self._verifier_pages.pop(seq.seq_id, None)
        if verifier is not None:
            self.verifier_cache.free_cache_pages(verifier)
        seq.computed = 0  # nothing is published: a diffusion prompt's K/V depend on its canvas
        super()._stop_running(seq)
