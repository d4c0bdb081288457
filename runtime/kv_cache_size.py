"""How many KV-cache pages a service allocates, and why.

A page count given; a byte budget; a fraction of the device's memory that the whole process may
use once the weights are loaded (vLLM's `--gpu-memory-utilization`: what is in use after loading,
by this process and any other, counts against it); or, by default, the export's own page count
(whose fixed-shape decodes take exactly that many pages) cut down where it would not fit in
DEFAULT_MEMORY_FRACTION of the device. Light on purpose (no iree, no numpy).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from .devices import CPU_DRIVERS
from .service_config import DEFAULT_MEMORY_FRACTION

MIN_PAGES = 2  # page 0 is reserved

MEMINFO = Path("/proc/meminfo")
CGROUP = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class DeviceMemory:
    """A device's memory in bytes: all of it, and what is free now."""

    total: int
    free: int

    def room(self, fraction: float) -> int:
        """Bytes that may still be taken before `fraction` of the total is in use."""
        return max(0, int(fraction * self.total) - (self.total - self.free))


@dataclass(frozen=True)
class KvCacheSize:
    pages: int
    reason: str  # how the count was chosen, for the load log


def _mib(size: int) -> str:
    return f"{size / 2**20:,.0f} MiB"


def _gib(size: int) -> str:
    return f"{size / 2**30:.1f} GiB"


def host_memory(meminfo: Path = MEMINFO, cgroup: Path = CGROUP) -> DeviceMemory | None:
    """This machine's memory (MemTotal, MemAvailable), bounded by the cgroup v2 limit a container
    runs under."""
    try:
        fields = dict(line.split(":", 1) for line in meminfo.read_text().splitlines() if ":" in line)
        total = int(fields["MemTotal"].split()[0]) * 1024
        free = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError, IndexError):
        return None
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            used = int((cgroup / "memory.current").read_text().strip())
            total, free = min(total, int(limit)), min(free, max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return DeviceMemory(total, free)


def _run(command: list[str]) -> str | None:
    if shutil.which(command[0]) is None:
        return None
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def _ordinals(uri: str) -> list[str]:
    """The device ordinals a URI list names ("cuda://0,cuda://2" -> ["0", "2"]; none -> ["0"])."""
    ordinals = [part.split("://", 1)[1] for part in uri.split(",") if "://" in part]
    return [o for o in ordinals if o.isdigit()] or ["0"]


def nvidia_memory(uri: str) -> DeviceMemory | None:
    text = _run(["nvidia-smi", "--query-gpu=index,memory.total,memory.free", "--format=csv,noheader,nounits"])
    if text is None:
        return None
    rows = {}
    for line in text.strip().splitlines():
        try:
            index, total, free = (part.strip() for part in line.split(","))
            rows[index] = DeviceMemory(int(total) * 2**20, int(free) * 2**20)
        except ValueError:
            return None
    return rows.get(_ordinals(uri)[0])


def rocm_memory(uri: str) -> DeviceMemory | None:
    text = _run(["rocm-smi", "--showmeminfo", "vram", "--json"])
    try:
        card = json.loads(text or "")[f"card{_ordinals(uri)[0]}"]
        total = int(card["VRAM Total Memory (B)"])
        return DeviceMemory(total, total - int(card["VRAM Total Used Memory (B)"]))
    except (ValueError, KeyError, TypeError):
        return None


def device_memory(uri: str) -> DeviceMemory | None:
    """The memory of the device a cache lives on (the first, for a multi-device program), or None
    where it cannot be asked."""
    driver = uri.split(",")[0].split("://")[0]
    if driver in CPU_DRIVERS:
        return host_memory()
    if driver == "cuda":
        return nvidia_memory(uri)
    if driver == "hip":
        return rocm_memory(uri)
    return None


def choose_pages(*, page_bytes: int, export_pages: int, pages: int = 0, memory_bytes: int = 0,
                 memory_fraction: float = 0.0, memory: DeviceMemory | None = None,
                 devices: int = 1) -> KvCacheSize:
    """The cache's page count from what was asked (at most one of `pages`, `memory_bytes`,
    `memory_fraction`) and the device's memory as it stands with the weights loaded; ValueError
    when no cache of MIN_PAGES fits. `page_bytes` counts every device's share of a page; `memory` is
    one device's, each of `devices` holding an even share."""
    if pages:
        return KvCacheSize(pages, "--kv-cache-pages")
    if memory_bytes:
        chosen = memory_bytes // page_bytes
        if chosen < MIN_PAGES:
            raise ValueError(f"--kv-cache-memory {_mib(memory_bytes)} holds {chosen} page(s) of {page_bytes:,} bytes; "
                             f"the KV cache needs at least {MIN_PAGES}")
        return KvCacheSize(chosen, f"--kv-cache-memory {_mib(memory_bytes)}")
    fraction = memory_fraction or DEFAULT_MEMORY_FRACTION
    if memory is None:
        if memory_fraction:
            raise ValueError(f"--kv-cache-memory {memory_fraction}: this device's free memory cannot be read here; "
                             "give the cache's size in bytes (e.g. --kv-cache-memory 4GiB) or --kv-cache-pages")
        return KvCacheSize(export_pages, "the export's device_block_count (the device's free memory is unknown)")
    room = memory.room(fraction) * devices
    fits = room // page_bytes
    in_use = f"{_gib(memory.total - memory.free)} of {_gib(memory.total)} in use after loading"
    if memory_fraction:
        if fits < MIN_PAGES:
            raise ValueError(f"--kv-cache-memory {memory_fraction}: {in_use} leaves {_mib(room)} below "
                             f"{memory_fraction:.0%} of the device, not {MIN_PAGES} pages of {page_bytes:,} bytes")
        return KvCacheSize(fits, f"--kv-cache-memory {memory_fraction} ({in_use})")
    if fits >= export_pages:
        return KvCacheSize(export_pages, f"the export's device_block_count ({in_use})")
    if fits < MIN_PAGES:
        raise ValueError(f"the KV cache does not fit: {in_use} leaves {_mib(room)} below {fraction:.0%} of the "
                         f"device, not {MIN_PAGES} pages of {page_bytes:,} bytes; free memory, or give "
                         "--kv-cache-memory or --kv-cache-pages")
    return KvCacheSize(fits, f"cut from the export's {export_pages} pages to fit {fraction:.0%} of the device's "
                             f"memory ({in_use})")
