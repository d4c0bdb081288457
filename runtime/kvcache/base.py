"""The KV cache's interface: what the scheduler may ask of it, and what it promises.

Everything about the KV cache lives in this package: the device's pages (`page_pool.py`), the
two caches (`trie_cache.py` shares full pages between sequences with a common prefix;
`plain_cache.py` gives every sequence its own), the tiers below the device (`host_tier.py`,
`disk_tier.py`, run for a service by `tiers.py`) and the prefix cache's events (`events.py`).
Outside it, the scheduler holds `PageAllocation`s and calls the methods below; nothing else
reaches into the trie. The method names are shortfin's.

What holds, for every implementation:
- **On the device.** Every page an allocation lists is a device page for as long as the
  allocation is not released. Page 0 is never handed out: padding rows write there.
- **Written.** The cache never writes K/V; the model's calls do, into the pages the scheduler
  passed them. A sequence's pages hold its K/V up to the tokens the scheduler counted as
  computed, and `cached_tokens` of a fresh allocation are already there (a prefix hit).
- **Published.** `publish_allocated_pages` offers the full pages of tokens whose K/V are
  written. From then on another sequence whose tokens start the same may be given those pages
  instead of computing them (with `shares_prefixes`); a partial last page is never shared,
  and at least the last token of a prompt is always left to compute.
- **Evictable.** A published page that no live allocation references is held by the cache
  alone: it may be evicted, least recently used first, only when the pool cannot otherwise
  supply pages (its K/V moving to the host tier where there is one). A page any live
  allocation references is never evicted or handed to another owner.
- **Between steps.** Pages change hands (acquired, freed, evicted, restored from the host tier)
  only between model calls, and the copies between the device and the host are made then, on
  the device's thread (`tiers.KvTiers.flush`), so no call reads a page while it moves.
- **Windowed.** With a pool whose pages hold sliding-window layers apart (window_pool.py), a
  sequence watches the pages of its blocks from `window_start` on; `advance` moves that start as
  its K/V are written, and the pages left behind lose their sliding layers' pages once nothing else
  needs them. A prefix is served only as far as the pages its first query may see still have them.
- **Counted.** The pool's reference count on a page is its number of holders (the cache's
  one while it caches it, plus one per allocation): the page is free exactly when it is zero.
  `check_integrity` asserts this accounting.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from .page_pool import PagePool
from .window_pool import WindowPagePool


@dataclass
class PageAllocation:
    """The pages one sequence holds, in sequence order."""

    pages: list[int]
    # Tokens at the start of the sequence whose K/V the pages already hold (a prefix-cache
    # hit): always a multiple of block_seq_stride and less than the sequence's length, so at
    # least one token is left to compute.
    cached_tokens: int = 0
    # With a pool that lets sliding layers' pages go (window_pool.py): the blocks whose pages the
    # sequence watches, window_start up to window_end (those a query still to come may see, up to
    # the last it is about to write).
    window_start: int = 0
    window_end: int = 0
    # Implementation state (trie nodes referenced, pages published...).
    handle: Any = field(default=None, repr=False)
    released: bool = False


@dataclass
class CacheStats:
    total: int  # pages a request can ever get (page 0 excluded)
    free: int  # in the pool, never allocated or released
    cached: int  # held only by the prefix cache: evictable
    active: int  # referenced by sequences in flight
    hit_tokens: int = 0  # prefix tokens served from device pages, since start
    host_total: int = 0  # the host tier's slots (0: no host tier)
    host_used: int = 0  # slots holding a page's copy
    host_hit_tokens: int = 0  # prefix tokens copied back from the host tier instead of computed
    disk_hit_tokens: int = 0  # prefix tokens read back from the disk tier instead of computed


class BasePagedAttentionCache(ABC):
    shares_prefixes = False  # whether a published page can serve another sequence's prefix

    def __init__(self, page_pool: PagePool, block_seq_stride: int, lazy_windows: bool = False):
        """`lazy_windows`: with a window pool, a block's sliding pages are given when
        `extend_allocation` covers it, as a scheduler does before every call that writes it
        (rather than with its page), so that a long prompt holds them only as its chunks pass."""
        self.page_pool = page_pool
        self.block_seq_stride = block_seq_stride
        self.lazy_windows = lazy_windows

    def pages_for(self, token_count: int) -> int:
        return -(-token_count // self.block_seq_stride)

    @abstractmethod
    def acquire_pages_for_tokens(self, tokens: list[int], extra_token_slots: int = 0) -> PageAllocation | None:
        """Pages covering len(tokens) + extra_token_slots positions, reusing a cached prefix.

        Returns None, holding nothing, when the pool cannot supply the pages even after
        evicting what the cache may evict.
        """

    def extend_allocation(self, allocation: PageAllocation, token_count: int) -> bool:
        """Grow `allocation` to cover `token_count` positions (with a window pool, its blocks' sliding
        pages too); False (unchanged) if no pages."""
        assert not allocation.released, "extend of a freed allocation"
        blocks = self.pages_for(token_count)
        missing = blocks - len(allocation.pages)
        pages = self._acquire_private(missing) if missing > 0 else []
        if pages is None:
            return False
        allocation.pages.extend(pages)
        if self.windowed is not None and not self._open_window(allocation, blocks if self.lazy_windows
                                                                else len(allocation.pages)):
            del allocation.pages[len(allocation.pages) - len(pages):]
            self._release_private(pages)
            return False
        return True

    def _open_window(self, allocation: PageAllocation, blocks: int) -> bool:
        """The allocation watches its pages up to block `blocks` (given their sliding pages, making
        room in the cache if it must); False, unchanged, where there is none."""
        if blocks <= allocation.window_end:
            return True
        while not self.windowed.watch(allocation.pages[allocation.window_end : blocks]):
            if not self._make_room():
                return False
        allocation.window_end = blocks
        return True

    def _make_room(self) -> bool:
        """Let go of a cached page to make room; False where there is none."""
        return False

    def _release_private(self, pages: list[int]) -> None:
        """Give back fresh pages an allocation took and does not keep."""
        self.page_pool.release(pages)

    @property
    def windowed(self) -> WindowPagePool | None:
        """The pool, where it lets sliding layers' pages go (window_pool.py); else None."""
        pool = self.page_pool
        return pool if isinstance(pool, WindowPagePool) and pool.release_windows else None

    def window_start_for(self, position: int) -> int:
        """The first block a query at `position` (and every later one) may see in a sliding layer."""
        return max(0, position - self.windowed.groups.window + 1) // self.block_seq_stride

    def advance(self, allocation: PageAllocation, computed: int) -> None:
        """`computed` tokens of the allocation's sequence have their K/V written: it stops watching
        the pages its queries to come can no longer see, whose sliding layers' pages may then go."""
        if self.windowed is None or allocation.released:
            return
        start = min(self.window_start_for(computed), allocation.window_end)
        if start > allocation.window_start:
            self.windowed.unwatch(allocation.pages[allocation.window_start : start])
            allocation.window_start = start

    def _leave_window(self, allocation: PageAllocation) -> None:
        """The sequence ends: it watches none of its pages any more."""
        if self.windowed is not None:
            self.windowed.unwatch(allocation.pages[allocation.window_start : allocation.window_end])

    @abstractmethod
    def _acquire_private(self, count: int) -> list[int] | None:
        """`count` pages for one sequence alone (evicting what may be evicted), or None."""

    @abstractmethod
    def publish_allocated_pages(self, allocation: PageAllocation, tokens: list[int]) -> None:
        """`tokens` (the sequence so far) now have their K/V written: share its full pages."""

    @abstractmethod
    def free_cache_pages(self, allocation: PageAllocation) -> None:
        """The sequence is done: drop its references (idempotent)."""

    def clear_unreferenced(self) -> int:
        """Drop every cached page no sequence uses, in every tier but disk; returns how many
        (a cache that shares no prefixes keeps none). No host copy may be pending."""
        return 0

    @abstractmethod
    def stats(self) -> CacheStats: ...

    def _check_windows(self, allocations) -> None:
        """Each page is watched by exactly the live allocations whose window holds it."""
        if self.windowed is None:
            return
        watching: dict[int, int] = {}
        for allocation in allocations:
            assert 0 <= allocation.window_start <= allocation.window_end <= len(allocation.pages), (
                "window outside the pages")
            for page in allocation.pages[allocation.window_start : allocation.window_end]:
                watching[page] = watching.get(page, 0) + 1
        for page, count in enumerate(self.windowed.watchers):
            assert count == watching.get(page, 0), f"page {page}: watched {count}, in {watching.get(page, 0)} windows"

    @abstractmethod
    def check_integrity(self) -> None:
        """Raise AssertionError if the accounting is inconsistent (tests call it after each scenario)."""
