"""Where a model's parameters (the .irpa) live in host memory while IREE reads them.

- "mapped": the file mapped as it is (IREE's default). The pages are the page cache's, shared by
  every process that maps the file (data-parallel replicas on one machine hold one copy), in 4
  KiB pages.
- "private": the file read into this process's own anonymous memory, advised for transparent
  huge pages (MADV_HUGEPAGE). On the CPU a decode step streams every weight once; 2 MiB pages
  take the TLB misses of that stream away (a float32 decode step of SmolLM2 2-3% faster,
  benchmarks/NOTES.md). IREE imports the memory as it is, so the process holds one copy, not two.
- "auto": private for a CPU device where the kernel offers huge pages on request, else mapped
  (a GPU device copies the parameters into its own memory either way).
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

from iree import runtime as ireert

PARAMETER_MEMORY = ("auto", "mapped", "private")
_HUGE_PAGES_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_on_request() -> bool:
    """Whether MADV_HUGEPAGE gets huge pages here: Linux with transparent huge pages set to
    "madvise" or "always" (the selected one is bracketed)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        setting = _HUGE_PAGES_SETTING.read_text()
    except OSError:
        return False
    return "[madvise]" in setting or "[always]" in setting


def resolved(memory: str, device: str) -> str:
    """"mapped" or "private" for `memory` (one of PARAMETER_MEMORY) on `device`."""
    if memory not in PARAMETER_MEMORY:
        raise ValueError(f"parameter memory must be one of {', '.join(PARAMETER_MEMORY)}, got {memory!r}")
    if memory != "auto":
        return memory
    return "private" if device.startswith("local") and huge_pages_on_request() else "mapped"


class ParameterArchive:
    """The parameter index of one .irpa, and the memory it reads from where that is this
    process's own (kept alive as long as the archive is)."""

    def __init__(self, path: str | Path, memory: str = "mapped"):
        self.index = ireert.ParameterIndex()
        self.memory = memory
        self._region: mmap.mmap | None = None
        if memory == "mapped":
            self.index.load(str(path))
            return
        size = os.path.getsize(path)
        # MAP_PRIVATE: a shared anonymous mapping is shmem, which takes huge pages only where
        # shmem's own setting allows.
        self._region = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            self._region.madvise(mmap.MADV_HUGEPAGE)
        contents = memoryview(self._region)[:size]
        with open(path, "rb") as file:
            read = file.readinto(contents)
        if read != size:
            raise OSError(f"{path}: read {read} of {size} bytes")
        self._handle = ireert.FileHandle.wrap_memory(contents)
        self.index.load_from_file_handle(self._handle, "irpa")

    def provider(self, scope: str):
        return self.index.create_provider(scope=scope)
