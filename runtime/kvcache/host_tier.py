"""KV pages kept in host memory, below the device's page pool (SGLang's HiCache, vLLM's KV
offloading): the prefix cache moves a page's K/V here instead of dropping it, and back to a
device page when a prompt needs it again, which costs a copy instead of a prefill.

The tier owns the host slots and the copies waiting to be made. The prefix cache decides
what moves (`copy_to_host`, `copy_to_device`); the batcher makes the copies (`flush`) on
the device's thread between steps, when no call reads or writes the pages: device to host
first, so a device page handed to a new owner is read before it is overwritten, then pages
read from disk into their slots, then host to device.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

WRITE_POLICIES = ("write_through", "write_back")


@dataclass
class TransferCounters:
    pages_to_host: int = 0
    pages_to_device: int = 0
    bytes_to_host: int = 0
    bytes_to_device: int = 0


class HostKvTier:
    def __init__(self, slot_count: int, page_elems: int, dtype: np.dtype, write_policy: str = "write_through",
                 rows_of=None):
        """`page_elems`: a slot's elements; `rows_of(page)`, where a page the cache hands out is
        backed by several rows of the device's buffer (window_pool.py: one per group of layers), those
        rows, read when a copy is queued (the page may change hands before the flush)."""
        if slot_count < 1:
            raise ValueError(f"a host KV tier needs at least one page, got {slot_count}")
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"write policy must be one of {', '.join(WRITE_POLICIES)}, got {write_policy!r}")
        # write_through: a page is copied as it is published, so eviction only drops the device
        # page; write_back: copied when evicted from the device (fewer copies, a copy at eviction).
        self.write_policy = write_policy
        self.storage = np.zeros((slot_count, page_elems), dtype=dtype)
        self.page_bytes = page_elems * np.dtype(dtype).itemsize
        self._free: deque[int] = deque(range(slot_count))
        self._rows_of = rows_of or (lambda page: page)
        # (device page or rows, slot, owner) waiting for flush
        self._to_host: list[tuple[int | list[int], int, object]] = []
        self._fills: list[tuple[int, np.ndarray]] = []  # (slot, K/V read from disk)
        self._to_device: list[tuple[int, int | list[int]]] = []  # (slot, device page or rows)
        self.counters = TransferCounters()

    @property
    def slot_count(self) -> int:
        return len(self.storage)

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def write_through(self) -> bool:
        return self.write_policy == "write_through"

    def take_slot(self) -> int | None:
        return self._free.popleft() if self._free else None

    def free_slot(self, slot: int) -> None:
        self._free.append(slot)

    def copy_to_host(self, page: int, slot: int, owner: object = None) -> None:
        """Queue a copy; `owner` comes back from the flush that makes it (the disk tier saves it)."""
        self._to_host.append((self._rows_of(page), slot, owner))

    def fill(self, slot: int, data: np.ndarray) -> None:
        """Queue K/V from elsewhere (the disk tier) into a slot, made in order with the copies."""
        self._fills.append((slot, data))

    def copy_to_device(self, slot: int, page: int) -> None:
        self._to_device.append((slot, self._rows_of(page)))

    @property
    def pending(self) -> bool:
        return bool(self._to_host or self._fills or self._to_device)

    def flush(self, device_pages: np.ndarray) -> list[tuple[object, int]]:
        """Make the waiting copies against `device_pages`, the KV cache mapped into host memory
        ([page_count, page_elems]); runs where the model's calls run, between two of them.
        Returns (owner, slot) of each copy made to the host."""
        to_host, self._to_host = self._to_host, []
        fills, self._fills = self._fills, []
        to_device, self._to_device = self._to_device, []
        # A page is one row of `device_pages` (which may be a multi-device program's joined view,
        # devices.ShardedPageView, indexed by one page at a time) or, with `rows_of`, several.
        for rows, slot, _ in to_host:
            self.storage[slot] = device_pages[rows] if isinstance(rows, int) else device_pages[rows].reshape(-1)
        for slot, data in fills:
            self.storage[slot] = data
        for slot, rows in to_device:
            if isinstance(rows, int):
                device_pages[rows] = self.storage[slot]
            else:
                device_pages[rows] = self.storage[slot].reshape(len(rows), -1)
        counters = self.counters
        counters.pages_to_host += len(to_host)
        counters.pages_to_device += len(to_device)
        counters.bytes_to_host += len(to_host) * self.page_bytes
        counters.bytes_to_device += len(to_device) * self.page_bytes
        return [(owner, slot) for _, slot, owner in to_host]

    def check_integrity(self, slots_in_use: list[int]) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a host slot is free twice"
        used = set(slots_in_use)
        assert len(used) == len(slots_in_use), "a host slot is held twice"
        assert not used & free, "a held host slot is on the free list"
        assert len(used) + len(free) == self.slot_count, "a host slot is held by nobody"
