"""A KV cache without prefix sharing: every sequence gets fresh pages of its own.

The baseline the trie cache is measured against, and the fallback when sharing
is switched off (e.g. to rule the trie out while debugging).
"""

from __future__ import annotations

from .base import BasePagedAttentionCache, CacheStats, PageAllocation
from .page_pool import PagePool


class PlainPagedAttentionCache(BasePagedAttentionCache):
    def __init__(self, page_pool: PagePool, block_seq_stride: int, lazy_windows: bool = False):
        super().__init__(page_pool, block_seq_stride, lazy_windows)
        # Live allocations by identity, so check_integrity can account for every page.
        self._live: dict[int, PageAllocation] = {}

    def acquire_pages_for_tokens(self, tokens: list[int], extra_token_slots: int = 0) -> PageAllocation | None:
        pages = self._acquire_private(self.pages_for(len(tokens) + extra_token_slots))
        if pages is None:
            return None
        allocation = PageAllocation(pages=pages)
        self._live[id(allocation)] = allocation
        if self.windowed is not None and not self.lazy_windows and not self._open_window(allocation, len(pages)):
            self.free_cache_pages(allocation)
            return None
        return allocation

    def _acquire_private(self, count: int) -> list[int] | None:
        return self.page_pool.acquire(count)

    def publish_allocated_pages(self, allocation: PageAllocation, tokens: list[int]) -> None:
        """Nothing is shared, so there is nothing to publish."""

    def free_cache_pages(self, allocation: PageAllocation) -> None:
        if allocation.released:
            return
        self._leave_window(allocation)
        allocation.released = True
        self._live.pop(id(allocation), None)
        self.page_pool.release(allocation.pages)

    def stats(self) -> CacheStats:
        pool = self.page_pool
        return CacheStats(total=pool.total, free=pool.free_count, cached=0, active=pool.total - pool.free_count)

    def check_integrity(self) -> None:
        pool = self.page_pool
        pool.check_integrity()
        seen: set[int] = set()
        for allocation in self._live.values():
            assert not allocation.released, "a freed allocation is still live"
            assert allocation.cached_tokens == 0, "the plain cache never reports a hit"
            for page in allocation.pages:
                assert page != 0, "page 0 was handed to a sequence"
                assert page not in seen, f"page {page} is held by two sequences"
                assert pool.refcounts[page] == 1, f"page {page}: refcount {pool.refcounts[page]}, expected 1"
                seen.add(page)
        self._check_windows(self._live.values())
        assert len(seen) + pool.free_count == pool.total, (
            f"{pool.total - pool.free_count - len(seen)} pages leaked (held by no live sequence)"
        )
