"""How many KV pages a service allocates (runtime/kv_cache_size.py): from pages, bytes, a share of
the device's memory, or the export's count where it fits; and the host's memory as a container
sees it."""

from __future__ import annotations

import pytest

from kiln.runtime.kv_cache_size import DeviceMemory, choose_pages, host_memory

GiB, MiB = 2**30, 2**20
PAGE = 4 * MiB


def test_a_page_count_or_a_byte_budget_is_taken_as_given():
    assert choose_pages(page_bytes=PAGE, export_pages=256, pages=40).pages == 40
    size = choose_pages(page_bytes=PAGE, export_pages=256, memory_bytes=GiB + 3)
    assert size.pages == 256 and "--kv-cache-memory 1,024 MiB" in size.reason
    with pytest.raises(ValueError, match="holds 1 page"):
        choose_pages(page_bytes=PAGE, export_pages=256, memory_bytes=PAGE + 1)


def test_a_share_of_memory_counts_everything_in_use_against_it():
    memory = DeviceMemory(total=16 * GiB, free=10 * GiB)  # 6 GiB in use with the weights loaded
    assert memory.room(0.5) == 2 * GiB and memory.room(0.25) == 0
    size = choose_pages(page_bytes=PAGE, export_pages=256, memory_fraction=0.5, memory=memory)
    assert size.pages == 2 * GiB // PAGE and "6.0 GiB of 16.0 GiB in use" in size.reason
    # Two devices of a tensor-parallel program each hold half of every page.
    assert choose_pages(page_bytes=PAGE, export_pages=256, memory_fraction=0.5, memory=memory, devices=2).pages == 1024
    with pytest.raises(ValueError, match="below 30% of the device"):
        choose_pages(page_bytes=PAGE, export_pages=256, memory_fraction=0.3, memory=memory)
    with pytest.raises(ValueError, match="cannot be read here; give the cache's size in bytes"):
        choose_pages(page_bytes=PAGE, export_pages=256, memory_fraction=0.5, memory=None)


def test_the_default_is_the_exports_count_cut_down_to_fit():
    roomy = DeviceMemory(total=64 * GiB, free=60 * GiB)
    size = choose_pages(page_bytes=PAGE, export_pages=256, memory=roomy)
    assert size.pages == 256 and size.reason.startswith("the export's device_block_count")
    tight = DeviceMemory(total=10 * GiB, free=1.5 * GiB)  # 8.5 in use: 0.5 GiB left below 90%
    size = choose_pages(page_bytes=PAGE, export_pages=256, memory=tight)
    assert size.pages == 128 and "cut from the export's 256 pages to fit 90%" in size.reason
    with pytest.raises(ValueError, match="the KV cache does not fit"):
        choose_pages(page_bytes=PAGE, export_pages=256, memory=DeviceMemory(total=10 * GiB, free=GiB))
    unknown = choose_pages(page_bytes=PAGE, export_pages=256, memory=None)
    assert unknown.pages == 256 and "unknown" in unknown.reason


def test_host_memory_is_bounded_by_the_containers_limit(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:  1000 kB\nMemAvailable:   20000000 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    assert host_memory(meminfo, cgroup) == DeviceMemory(24000000 * 1024, 20000000 * 1024)
    (cgroup / "memory.max").write_text("max\n")
    assert host_memory(meminfo, cgroup).total == 24000000 * 1024
    (cgroup / "memory.max").write_text(f"{8 * GiB}\n")
    (cgroup / "memory.current").write_text(f"{3 * GiB}\n")
    assert host_memory(meminfo, cgroup) == DeviceMemory(8 * GiB, 5 * GiB)
    assert host_memory(tmp_path / "missing", cgroup) is None
