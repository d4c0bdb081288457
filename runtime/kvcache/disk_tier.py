"""KV pages on disk, so a restarted server serves a known prefix without computing it again
(llama.cpp's slot save/restore, kept per page as the prefix cache keeps them).

A page is one file, named by its block hash (its tokens chained to its parent's, as the KV
events name it), in a directory of the model's fingerprint: its parameters, its export's
config and the page layout, so one directory can serve several models and exports. Each
file repeats what it is (the fingerprint, the parent's hash, the tokens) and a digest of its
K/V; a file that does not match, whatever the reason, is ignored with a warning (and removed),
never used.
Files are written by one background thread, whole or not at all (a temporary file, renamed).
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger("kiln.kvcache")
MAGIC = b"KILNKV01"
_HEAD = struct.Struct("<8s32sqI")  # magic, fingerprint, parent hash, token count
_DIGEST_BYTES = 16


def model_fingerprint(config_files: list[Path], params_file: Path, page_layout: str) -> bytes:
    """What a page's K/V depend on besides its tokens: the export's config, the parameters (their
    size and their first and last MiB, read in a moment even for gigabytes) and the page layout."""
    digest = hashlib.sha256(page_layout.encode())
    for path in config_files:
        digest.update(Path(path).read_bytes() if Path(path).is_file() else b"-")
    size = Path(params_file).stat().st_size
    digest.update(struct.pack("<q", size))
    with open(params_file, "rb") as f:
        digest.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        digest.update(f.read(1 << 20))
    return digest.digest()


@dataclass(frozen=True)
class DiskPage:
    """A page to read or write: who it is (as the prefix cache names it) and what it holds."""

    block_hash: int
    parent_hash: int | None
    tokens: tuple[int, ...]


class DiskKvStore:
    def __init__(self, directory: Path, fingerprint: bytes, page_elems: int, dtype: np.dtype):
        self.fingerprint = fingerprint
        self.directory = Path(directory) / fingerprint.hex()[:24]
        self.directory.mkdir(parents=True, exist_ok=True)
        self.page_elems = page_elems
        self.dtype = np.dtype(dtype)
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kiln-kv-disk")
        self.pages_written = 0
        self.pages_read = 0
        self.pages_refused = 0
        self.pages_stored = sum(1 for _ in self.directory.glob("*.kvpage"))  # files of this model, kept

    def path(self, block_hash: int) -> Path:
        return self.directory / f"{block_hash & (2**64 - 1):016x}.kvpage"

    def has(self, page: DiskPage) -> bool:
        return self.path(page.block_hash).is_file()

    # -- writing (on the writer thread) ----------------------------------------------------
    def save(self, page: DiskPage, data: np.ndarray) -> Future:
        """Write a page (unless its file exists); `data` is the caller's copy, kept until written."""
        return self._writer.submit(self._write, page, data)

    def _write(self, page: DiskPage, data: np.ndarray) -> bool:
        path = self.path(page.block_hash)
        if path.is_file():
            return False
        payload = np.ascontiguousarray(data, dtype=self.dtype).tobytes()
        head = _HEAD.pack(MAGIC, self.fingerprint, page.parent_hash or 0, len(page.tokens))
        body = struct.pack(f"<{len(page.tokens)}I", *page.tokens)
        digest = hashlib.blake2b(payload, digest_size=_DIGEST_BYTES).digest()
        temporary = path.with_suffix(f".tmp{os.getpid()}")
        temporary.write_bytes(head + body + digest + payload)
        temporary.replace(path)
        self.pages_written += 1
        self.pages_stored += 1
        return True

    def wait_for_writes(self) -> None:
        self._writer.submit(lambda: None).result()

    def close(self) -> None:
        self._writer.shutdown(wait=True)

    # -- reading (on a worker thread) ------------------------------------------------------
    def read_run(self, pages: list[DiskPage]) -> list[np.ndarray]:
        """The K/V of the leading `pages` whose files exist and check out; stops at the first
        that does not (a prefix needs every page before it)."""
        found = []
        for page in pages:
            data = self._read(page)
            if data is None:
                break
            found.append(data)
        self.pages_read += len(found)
        return found

    def _read(self, page: DiskPage) -> np.ndarray | None:
        path = self.path(page.block_hash)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as error:
            return self._refuse(path, f"unreadable: {error}")
        expected = self.page_elems * self.dtype.itemsize
        start = _HEAD.size + 4 * len(page.tokens) + _DIGEST_BYTES
        if len(raw) != start + expected:
            return self._refuse(path, f"{len(raw)} bytes, not the {start + expected} of a page of this model")
        magic, fingerprint, parent, count = _HEAD.unpack_from(raw)
        if magic != MAGIC or fingerprint != self.fingerprint:
            return self._refuse(path, "written for another model or export")
        tokens = struct.unpack_from(f"<{count}I", raw, _HEAD.size) if count == len(page.tokens) else ()
        if parent != (page.parent_hash or 0) or tuple(tokens) != tuple(page.tokens):
            return self._refuse(path, "it holds other tokens than its name says")
        payload = raw[start:]
        if hashlib.blake2b(payload, digest_size=_DIGEST_BYTES).digest() != raw[start - _DIGEST_BYTES:start]:
            return self._refuse(path, "its contents are corrupt")
        return np.frombuffer(payload, dtype=self.dtype).copy()

    def _refuse(self, path: Path, why: str) -> None:
        """Never served: removed, so the page is saved afresh once it is computed again."""
        self.pages_refused += 1
        log.warning("ignoring KV cache file %s: %s", path, why)
        if path.is_file():
            path.unlink(missing_ok=True)
            self.pages_stored -= 1
        return None
