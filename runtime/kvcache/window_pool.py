"""Pages for a model with sliding-window layers: a block's pages for those layers are let go once no
query to come can see it (vLLM's hybrid allocator, llama.cpp's SWA cache).

The export lays such a model's pages out by groups of layers of one kind (runtime/config.py's
PageGroups): a page holds a block of one group's layers, and a block of a sequence has a page in
every group. Allocations, the prefix cache and the scheduler keep dealing in one page a block (a
*logical* page, as PagePool hands out); this pool backs each with a *physical* page in every group
(`page_map[logical] = [physical per group]`, which the invocation turns into the functions' tables)
and lets the sliding groups' go when nothing needs them any more:

- A fresh page has its global groups' pages alone. A sequence watches the pages of its blocks that
  a query it has yet to compute may see, from the window of its next position to the last block it
  is about to write (the caches' `extend_allocation`); a page it starts watching without its
  sliding groups' pages is given them. As it advances, it stops watching the ones left behind (the
  caches' `advance`), and when it ends, all.
- A page no sequence watches keeps its sliding groups' pages only while something else holds it:
  a page its sequence alone held (private) loses them at once; a page the prefix cache holds keeps
  them as cache, let go least recently left first when a fresh page needs room, so that a prompt
  sharing the prefix can still start where its window is all on the device (TriePagedAttentionCache
  cuts a prefix hit back to where it is).
- A page whose last holder lets go frees its pages in every group.

Page 0 stays every group's padding page. `release_windows=False` keeps every group's page for as long
as the block is held (what a host tier below the cache needs: it copies a block whole).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

import numpy as np

from ..config import PageGroups
from .page_pool import PagePool


class WindowPagePool(PagePool):
    """A PagePool of logical pages (refcounts, free list, `total`) over `physical_count` physical
    pages, each logical page backed by one per group (`page_map`); `buffer` holds the physical ones."""

    def __init__(self, groups: PageGroups, physical_count: int, logical_count: int,
                 allocate_buffer: Callable[[int], Any] | None = None, release_windows: bool = True,
                 window_blocks: int | None = None):
        """`window_blocks`: the most blocks a sequence watches at once (`sized` works it out); None:
        as many as it holds, so that `sequence_capacity` assumes every group's page of each."""
        super().__init__(logical_count)
        self.groups = groups
        self.release_windows = release_windows
        self.physical = PagePool(physical_count)
        self.buffer = allocate_buffer(physical_count) if allocate_buffer else None
        self.page_map = np.zeros((logical_count, groups.count), np.int64)
        self._sliding = [group for group, sliding in enumerate(groups.sliding) if sliding]
        self.watchers = [0] * logical_count
        self.window_blocks = window_blocks or logical_count
        # Pages nothing watches whose sliding groups' pages are kept as cache: least recently left first.
        self._unwatched: OrderedDict[int, None] = OrderedDict()

    @classmethod
    def sized(cls, groups: PageGroups, blocks: int, block_seq_stride: int, max_seq_len: int,
              allocate_buffer: Callable[[int], Any] | None = None, release_windows: bool = True,
              step_tokens: int = 0) -> "WindowPagePool":
        """A pool with the memory of `blocks` blocks held whole (a page in every group; what a
        cache keeping every page would hold), and pages enough to name every block it can back:
        each holds its global groups' pages for good, and without those (every layer sliding) a
        sequence's window's worth of blocks backs a whole context's. `step_tokens`: the most a
        sequence writes in one call (a prefill chunk, a draft); 0: a whole context."""
        physical = blocks * groups.count
        global_groups = groups.count - sum(groups.sliding)
        # The blocks a sequence watches at once: its next query's window and the blocks it writes.
        window_blocks = -(-(groups.window + (step_tokens or max_seq_len)) // block_seq_stride) + 1
        if global_groups:
            logical = physical // global_groups
        else:
            logical = blocks * max(1, -(-max_seq_len // (window_blocks * block_seq_stride)))
        return cls(groups, physical + 1, logical + 1, allocate_buffer, release_windows, window_blocks)

    @property
    def buffer_pages(self) -> int:
        return self.physical.page_count

    @property
    def sequence_capacity(self) -> int:
        """The most blocks one sequence may hold: every group's page of the blocks it watches at
        once, the global groups' of the others."""
        total, count = self.physical.total, self.groups.count
        if not self.release_windows or self.window_blocks * count >= total:
            return total // count
        global_groups = count - len(self._sliding)
        spare = total - self.window_blocks * count
        return min(self.total, self.window_blocks + (spare // global_groups if global_groups else self.total))

    # --- what a cache asks --------------------------------------------------------------

    def _room(self) -> int:
        """Physical pages free, or free once the kept sliding pages are taken back."""
        return self.physical.free_count + len(self._unwatched) * len(self._sliding)

    def _take(self, count: int) -> list[int] | None:
        """`count` physical pages, taking kept sliding pages back (least recently left first) if
        it must; None, taking nothing, if they are not there."""
        if count > self._room():
            return None
        while self.physical.free_count < count:
            self._drop_sliding(next(iter(self._unwatched)))
        return self.physical.acquire(count)

    @property
    def _fresh_groups(self) -> list[int]:
        """The groups a fresh page has pages in: the global ones (`watch` gives the others), or all
        where every page is kept."""
        return [g for g in range(self.groups.count) if not self.release_windows or g not in self._sliding]

    @property
    def available_count(self) -> int:
        """Fresh pages `acquire` can back now."""
        groups = len(self._fresh_groups)
        return min(len(self._free), self._room() // groups) if groups else len(self._free)

    def acquire(self, count: int) -> list[int] | None:
        """`count` fresh pages, each with a page in its fresh groups."""
        if count > self.available_count:
            return None
        pages = super().acquire(count)
        groups = self._fresh_groups
        for page in pages:
            self.page_map[page, groups] = self._take(len(groups))
        return pages

    def rows_of(self, page: int) -> list[int]:
        """The buffer's rows backing `page`, a page per group (the host tier copies a block whole)."""
        return [int(p) for p in self.page_map[page]]

    def has_window(self, page: int) -> bool:
        """Whether `page` still has its sliding groups' pages (a query may read it in its window)."""
        return all(self.page_map[page, group] for group in self._sliding)

    def watch(self, pages: list[int]) -> bool:
        """A sequence starts watching `pages` (a cached prefix within its window, blocks it is about
        to write): those without their sliding groups' pages are given them. False, watching none,
        if there is no room for those."""
        bare = [page for page in pages if not self.has_window(page)]
        kept = [page for page in pages if self._unwatched.pop(page, 0) is None]  # not to be taken for the bare
        taken = self._take(len(bare) * len(self._sliding))
        if taken is None:
            self._unwatched.update(dict.fromkeys(kept))
            return False
        for page, at in zip(bare, range(0, len(taken), len(self._sliding))):
            self.page_map[page, self._sliding] = taken[at : at + len(self._sliding)]
        for page in pages:
            assert self.refcounts[page] > 0, f"watch of free page {page}"
            self.watchers[page] += 1
        return True

    def unwatch(self, pages: list[int]) -> None:
        """A sequence stops watching `pages` (left behind by its window, or the sequence ended)."""
        for page in pages:
            assert self.watchers[page] > 0, f"unwatch of page {page} that nothing watches"
            self.watchers[page] -= 1
            if self.watchers[page] or not self.release_windows:
                continue
            if self.refcounts[page] == 1:  # the unwatching sequence alone holds it
                self._drop_sliding(page)
            else:
                self._unwatched[page] = None

    # --- what backs a page --------------------------------------------------------------

    def _drop_sliding(self, page: int) -> None:
        self._unwatched.pop(page, None)
        self.physical.release([int(p) for p in self.page_map[page, self._sliding] if p])
        self.page_map[page, self._sliding] = 0

    def _freed(self, page: int) -> None:
        self._unwatched.pop(page, None)
        self.physical.release([int(p) for p in self.page_map[page] if p])
        self.page_map[page] = 0
        self.watchers[page] = 0

    def check_integrity(self) -> None:
        super().check_integrity()
        self.physical.check_integrity()
        global_groups = [g for g in range(self.groups.count) if g not in self._sliding]
        backing = self.page_map[self.page_map != 0]
        assert len(set(backing.tolist())) == len(backing), "a physical page backs two pages"
        assert len(backing) + self.physical.free_count == self.physical.total, "a physical page is held by nobody"
        for page in range(1, self.page_count):
            held, row = self.refcounts[page] > 0, self.page_map[page]
            assert (row[global_groups] != 0).all() if held else not row.any(), f"page {page}: map {row}, held={held}"
            assert held or not self.watchers[page], f"free page {page} is watched"
            if self.watchers[page]:
                assert self.has_window(page), f"watched page {page} lost its window"
            if page in self._unwatched:
                assert held and not self.watchers[page] and self.has_window(page), f"page {page} kept wrongly"
            elif held and not self.watchers[page] and self.release_windows and self._sliding:
                assert not self.has_window(page), f"page {page}'s window pages are held by nobody"
