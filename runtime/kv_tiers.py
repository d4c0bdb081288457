"""The prefix cache's tiers below the device built from a service's config: host memory
(always, when any is on) and disk (`--kv-cache-dir`). What runs them is kvcache/tiers.py.
"""

from __future__ import annotations

import logging
from pathlib import Path

from .config import sidecar_path
from .contract import Artifacts
from .errors import ModelLoadError
from .kvcache.disk_tier import DiskKvStore, model_fingerprint
from .kvcache.host_tier import HostKvTier
from .kvcache.page_pool import PagePool
from .kvcache.window_pool import WindowPagePool
from .program import Program
from .service_config import ServiceConfig

log = logging.getLogger("kiln.service")


def host_tier_for(config: ServiceConfig, pool: PagePool, program: Program, host_bytes: int,
                  prefix_sharing: str) -> HostKvTier:
    """The host-memory tier. Its copies are memcpys of the KV cache mapped into host memory, so
    the device's cache must be one the host can map (the CPU's)."""
    page_bytes = program.block_elems * program.cache_dtype.itemsize
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
    return HostKvTier(slots, program.block_elems, program.cache_dtype, config.host_kv_write_policy,
                      rows_of=pool.rows_of if isinstance(pool, WindowPagePool) else None)


def disk_store_for(config: ServiceConfig, artifacts: Artifacts, program: Program) -> DiskKvStore:
    layout = f"{program.block_elems}:{program.cache_dtype}:{program.capabilities.block_seq_stride}"
    config_files = [Path(artifacts.config), sidecar_path(Path(artifacts.config))]
    try:
        fingerprint = model_fingerprint(config_files, Path(artifacts.params), layout)
        store = DiskKvStore(Path(config.kv_cache_dir), fingerprint, program.block_elems, program.cache_dtype)
    except OSError as error:
        raise ModelLoadError(f"cannot use --kv-cache-dir {config.kv_cache_dir}: {error}") from None
    log.info("disk KV tier: %s", store.directory)
    return store
