"""The prefix cache's tiers below the device, as a service runs them: host memory (always, when
any is on) and disk. The batcher reads a prompt's saved pages before scheduling it
(`read_prefix`) and makes the host tier's waiting copies between steps (`flush`), whose pages
are then saved on disk; the admin routes save and restore by prompt.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from .disk_tier import DiskKvStore
from .host_tier import HostKvTier
from .trie_cache import TriePagedAttentionCache


class KvTiers:
    def __init__(self, cache: TriePagedAttentionCache, host: HostKvTier, disk: DiskKvStore | None):
        self.cache, self.host, self.disk = cache, host, disk
        cache.disk = disk

    @property
    def copies_pending(self) -> bool:
        """Whether copies between the device and the host wait to be made (`flush`)."""
        return bool(self.host.pending)

    async def flush(self, copy_pages: Callable[[HostKvTier], Awaitable[list]]) -> None:
        """Make the waiting copies, between steps, with `copy_pages` (the executor's, on the
        device's thread), then save what went to the host (on disk, where there is one)."""
        if self.host.pending:
            self.save_copies(await copy_pages(self.host))

    async def read_prefix(self, prompt_ids: list[int]) -> int:
        """The pages of a prompt's prefix the disk holds and the cache does not, read (off the
        event loop) into the host tier; returns how many."""
        if self.disk is None:
            return 0
        parent, pages = self.cache.disk_plan(prompt_ids)
        if not pages or not self.disk.has(pages[0]):  # the usual case, answered without a thread
            return 0
        data = await asyncio.to_thread(self.disk.read_run, pages)
        return self.cache.insert_from_disk(parent, pages[: len(data)], data)

    def save_copies(self, copied: list) -> None:
        """Pages a flush just copied to the host tier, saved as files (a background thread writes them)."""
        if self.disk is None:
            return
        for page, slot in self.cache.disk_pages(copied):
            self.disk.save(page, self.host.storage[slot].copy())

    async def save_prefix(self, prompt_ids: list[int], wake_batcher: Callable[[], None]) -> int:
        """A cached prompt's full pages on disk, whatever the write policy: copied to the host
        (the batcher makes the copies when it is next between steps), then saved; returns how
        many of them the disk holds."""
        path = self.cache.cached_path(prompt_ids)
        for node in path:
            self.cache.keep_on_host(node)
        while self.host.pending:
            wake_batcher()
            await asyncio.sleep(0.01)
        # Copies made earlier were saved then; a file removed since is written again.
        self.save_copies([(node, node.host_slot) for node in path if node.host_slot is not None])
        await asyncio.to_thread(self.disk.wait_for_writes)
        return sum(self.disk.has(page) for page in self.cache.disk_pages_of(prompt_ids))

    async def restore_prefix(self, prompt_ids: list[int]) -> int:
        """A prompt's pages read from disk into the host tier; how many of its full pages the
        cache now holds, in any tier."""
        await self.read_prefix(prompt_ids + [0])  # + [0]: its last page counts too
        return len(self.cache.cached_path(prompt_ids))

    def transfer_stats(self) -> dict:
        counters = self.host.counters
        stats = {"bytes_to_host": counters.bytes_to_host, "bytes_to_device": counters.bytes_to_device}
        if self.disk is not None:
            stats["disk_pages"] = {"written": self.disk.pages_written, "read": self.disk.pages_read,
                                   "refused": self.disk.pages_refused}
            stats["disk_pages_stored"] = self.disk.pages_stored
        return stats

    async def close(self) -> None:
        if self.disk is not None:
            await asyncio.to_thread(self.disk.close)  # every page handed to it is written
