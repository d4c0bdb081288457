"""The KV cache's pages: one device buffer allocated once, a free list and reference counts.

Page 0 is never handed out: padded batch rows and padding positions write there.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable


class PagePool:
    def __init__(self, page_count: int, allocate_buffer: Callable[[int], Any] | None = None):
        if page_count < 2:
            raise ValueError(f"a page pool needs at least 2 pages (page 0 is reserved), got {page_count}")
        self.page_count = page_count
        # The device buffer [page_count, page_elems]; None in tests that only count pages.
        self.buffer = allocate_buffer(page_count) if allocate_buffer else None
        self._free: deque[int] = deque(range(1, page_count))
        self.refcounts = [0] * page_count

    @property
    def total(self) -> int:
        return self.page_count - 1

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def buffer_pages(self) -> int:
        """Pages the device buffer holds."""
        return self.page_count

    @property
    def sequence_capacity(self) -> int:
        """The most pages one sequence can be sure to hold."""
        return self.total

    @property
    def available_count(self) -> int:
        """How many pages `acquire` could hand out now."""
        return len(self._free)

    def acquire(self, count: int) -> list[int] | None:
        """`count` free pages with a reference each, or None (taking nothing)."""
        if count > len(self._free):
            return None
        pages = [self._free.popleft() for _ in range(count)]
        for page in pages:
            self.refcounts[page] = 1
        return pages

    def retain(self, pages: list[int]) -> None:
        for page in pages:
            assert self.refcounts[page] > 0, f"retain of free page {page}"
            self.refcounts[page] += 1

    def release(self, pages: list[int]) -> None:
        """Drop one reference per page; a page whose count reaches 0 is free again."""
        for page in pages:
            assert page != 0 and self.refcounts[page] > 0, f"release of free page {page}"
            self.refcounts[page] -= 1
            if self.refcounts[page] == 0:
                self._free.append(page)
                self._freed(page)

    def _freed(self, page: int) -> None:
        """`page` has just gone back to the free list (what backs it, a subclass lets go of)."""

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a page is on the free list twice"
        assert 0 not in free and self.refcounts[0] == 0, "page 0 was handed out"
        for page in range(1, self.page_count):
            count = self.refcounts[page]
            assert count >= 0, f"page {page} has a negative reference count"
            assert (count == 0) == (page in free), f"page {page}: refcount {count}, free={page in free}"
