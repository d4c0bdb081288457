"""The disk KV tier: page files that check themselves, and the prefix cache reading them back."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from kiln.runtime.kvcache.disk_tier import DiskKvStore, DiskPage, model_fingerprint
from kiln.runtime.kvcache.host_tier import HostKvTier
from kiln.runtime.kvcache.page_pool import PagePool
from kiln.runtime.kvcache.trie_cache import TriePagedAttentionCache

STRIDE, ELEMS = 4, 6


def store(tmp_path, fingerprint: bytes = b"m" * 32) -> DiskKvStore:
    return DiskKvStore(tmp_path, fingerprint, ELEMS, np.float32)


def pages_of(tokens: list[int]) -> list[DiskPage]:
    cache = TriePagedAttentionCache(PagePool(4), STRIDE)
    return cache.disk_pages_of(tokens)


def test_a_page_file_reads_back_as_written(tmp_path):
    disk = store(tmp_path)
    [first, second] = pages_of(list(range(8)))
    assert second.parent_hash == first.block_hash and first.parent_hash is None
    data = np.arange(ELEMS, dtype=np.float32)
    assert disk.save(first, data).result() and disk.save(second, data + 1).result()
    assert not disk.save(first, data * 0).result()  # written once
    assert disk.pages_stored == 2 and store(tmp_path).pages_stored == 2  # counted again on opening
    found = disk.read_run([first, second])
    assert [d.tolist() for d in found] == [data.tolist(), (data + 1).tolist()]
    disk.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign", "other_tokens"])
def test_a_file_that_does_not_check_out_is_ignored_with_a_warning(tmp_path, caplog, damage):
    disk = store(tmp_path)
    [first, second] = pages_of(list(range(8)))
    disk.save(first, np.ones(ELEMS, np.float32)).result()
    disk.save(second, np.ones(ELEMS, np.float32)).result()
    path = disk.path(second.block_hash)
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[-3] ^= 0xFF
    elif damage == "truncate":
        raw = raw[:-4]
    elif damage == "foreign":  # another model's file under this one's name
        other = store(tmp_path / "other", b"x" * 32)
        other.save(second, np.ones(ELEMS, np.float32)).result()
        raw = bytearray(other.path(second.block_hash).read_bytes())
    else:
        raw = bytearray(path.read_bytes().replace(b"\x05\x00\x00\x00", b"\x09\x00\x00\x00", 1))
    path.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="kiln.kvcache"):
        found = disk.read_run([first, second])
    assert len(found) == 1 and disk.pages_refused == 1  # the prefix stops where the bad page is
    assert not path.exists() and disk.pages_stored == 1  # removed: saved afresh when computed again
    assert "ignoring KV cache file" in caplog.text


def test_the_fingerprint_follows_the_model_and_the_page_layout(tmp_path):
    config, params = tmp_path / "model.json", tmp_path / "model.irpa"
    config.write_text("{}")
    params.write_bytes(b"\0" * 1000)
    base = model_fingerprint([config], params, "layout")
    assert model_fingerprint([config], params, "layout") == base
    assert model_fingerprint([config], params, "other layout") != base
    params.write_bytes(b"\1" * 1000)
    assert model_fingerprint([config], params, "layout") != base


def test_the_prefix_cache_reads_a_prompts_pages_from_disk_before_computing_them(tmp_path):
    tokens = list(range(1, 14))  # three full pages and one token
    disk = store(tmp_path)
    for index, page in enumerate(pages_of(tokens[:12])):
        disk.save(page, np.full(ELEMS, index + 1, np.float32)).result()
    cache = TriePagedAttentionCache(PagePool(8), STRIDE, HostKvTier(8, ELEMS, np.float32))
    cache.disk = disk
    parent, wanted = cache.disk_plan(tokens)
    assert parent is cache.root and len(wanted) == 3
    data = disk.read_run(wanted)
    assert cache.insert_from_disk(parent, wanted, data) == 3
    allocation = cache.acquire_pages_for_tokens(tokens)
    assert allocation.cached_tokens == 12 and cache.stats().disk_hit_tokens == 12
    device = np.zeros((8, ELEMS), np.float32)
    cache.host.flush(device)
    assert [device[page][0] for page in allocation.pages[:3]] == [1, 2, 3]
    cache.free_cache_pages(allocation)
    cache.check_integrity()
    # What the trie now holds is not read again.
    assert cache.disk_plan(tokens)[1] == []
