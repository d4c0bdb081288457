"""The sequences waiting for pages, served by priority, then arrival.

A waiting sequence can be taken out wherever it is (an abort, a client gone, a drain):
that costs O(1) here. It is only forgotten, and skipped when it reaches the top of the
heap, so cancelling n waiting sequences costs O(n log n) in all, never a rebuild per
sequence. Forgotten entries are swept out once they outnumber the live ones.
"""

from __future__ import annotations

import heapq
import itertools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .request import Sequence


class WaitingQueue:
    def __init__(self):
        # (priority key, seq id, push count, sequence): the count keeps a sequence pushed again
        # after a removal from ever being compared with its own stale entry.
        self._heap: list[tuple[tuple, int, int, "Sequence"]] = []
        self._pushes = itertools.count()
        self._waiting: set[int] = set()  # seq ids in the queue; heap entries of others are stale

    def __len__(self) -> int:
        return len(self._waiting)

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def __contains__(self, seq: "Sequence") -> bool:
        return seq.seq_id in self._waiting

    def push(self, seq: "Sequence") -> None:
        if seq.seq_id in self._waiting:
            return
        self._waiting.add(seq.seq_id)
        heapq.heappush(self._heap, (seq.priority_key, seq.seq_id, next(self._pushes), seq))

    def peek(self) -> "Sequence | None":
        """The sequence served next, left in the queue; None when it is empty."""
        self._drop_stale_top()
        return self._heap[0][3] if self._heap else None

    def pop(self) -> "Sequence":
        self._drop_stale_top()
        _, seq_id, _, seq = heapq.heappop(self._heap)
        self._waiting.discard(seq_id)
        return seq

    def remove(self, seq: "Sequence") -> None:
        """Take seq out, wherever it is (nothing if it is not waiting)."""
        self._waiting.discard(seq.seq_id)
        if len(self._heap) > 64 and len(self._heap) > 2 * len(self._waiting):
            self._heap = [entry for entry in self._heap if entry[1] in self._waiting]
            heapq.heapify(self._heap)

    def _drop_stale_top(self) -> None:
        # A sequence removed and pushed again has two entries with one key: whichever comes
        # first serves, and the other is stale once it has been popped.
        heap = self._heap
        while heap and heap[0][1] not in self._waiting:
            heapq.heappop(heap)
