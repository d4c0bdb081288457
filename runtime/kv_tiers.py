"""The prefix cache's tiers below the device, as a service runs them: host memory (always, when
any is on) and disk (`--kv-cache-dir`). Built from the service's config; then the batcher
reads a prompt's saved pages before scheduling it (`read_prefix`) and hands over each flush's
host copies to be saved (`save_copies`); the admin routes save and restore by prompt.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from .config import sidecar_path
from .contract import Artifacts
from .errors import ModelLoadError
from .kvcache.disk_tier import DiskKvStore, model_fingerprint
from .kvcache.host_tier import HostKvTier
from .kvcache.page_pool import PagePool
from .kvcache.trie_cache import TriePagedAttentionCache
from .program import Program
from .service_config import ServiceConfig

log = logging.getLogger("kiln.service")


def host_tier_for(config: ServiceConfig, pool: PagePool, program: Program, host_bytes: int,
                  prefix_sharing: str) -> HostKvTier:
    """The host-memory tier. Its copies are memcpys of the KV cache mapped into host memory, so
    the device's cache must be one the host can map (the CPU's)."""
    page_bytes = program.params.page_elems * program.cache_dtype.itemsize
    if prefix_sharing != "trie":
        raise ModelLoadError("the host and disk KV tiers keep the prefix cache's pages: they need "
                             "--prefix-sharing trie (and an export whose prefill takes start positions)")
    slots = host_bytes // page_bytes
    if slots < 1:
        raise ModelLoadError(f"--host-kv-size {host_bytes} holds no page: a page is {page_bytes} bytes")
    pool.buffer.to_host()  # maps it where the device allows; copies it otherwise
    if not pool.buffer.is_host_accessible:
        raise ModelLoadError(f"the host KV tier needs a KV cache the host can map; {config.device}'s is "
                             "device-local memory")
    log.info("host KV tier: %d pages (%.0f MiB), %s", slots, slots * page_bytes / 2**20,
             config.host_kv_write_policy.replace("_", "-"))
    return HostKvTier(slots, program.params.page_elems, program.cache_dtype, config.host_kv_write_policy)


def disk_store_for(config: ServiceConfig, artifacts: Artifacts, program: Program) -> DiskKvStore:
    params = program.params
    layout = f"{params.page_elems}:{program.cache_dtype}:{program.capabilities.block_seq_stride}"
    config_files = [Path(artifacts.config), sidecar_path(Path(artifacts.config))]
    try:
        fingerprint = model_fingerprint(config_files, Path(artifacts.params), layout)
        store = DiskKvStore(Path(config.kv_cache_dir), fingerprint, params.page_elems, program.cache_dtype)
    except OSError as error:
        raise ModelLoadError(f"cannot use --kv-cache-dir {config.kv_cache_dir}: {error}") from None
    log.info("disk KV tier: %s", store.directory)
    return store


class KvTiers:
    def __init__(self, cache: TriePagedAttentionCache, host: HostKvTier, disk: DiskKvStore | None):
        self.cache, self.host, self.disk = cache, host, disk
        cache.disk = disk

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
