"""The cache a function is traced with: the shape and type of the real one (each device's part of a
sharded one), its memory never touched. A traced program keeps its example arguments, so a
zero-filled cache of the export's page count was held once per function."""

from __future__ import annotations

import torch

from kiln.export.exporter import example_cache
from kiln.models.llama import PagedLlama
from kiln.models.sharded_llama import ShardedPagedLlama
from kiln.runtime.device_layout import DeviceLayout
from tests.tiny_model import make_tiny_checkpoint


def _resident_mib() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


def test_an_example_cache_has_the_real_ones_shape_and_holds_no_memory():
    checkpoint = make_tiny_checkpoint(seed=1)
    model = PagedLlama(checkpoint.config, block_seq_stride=16)
    for dtype in (torch.float32, torch.int8):
        example = example_cache(model, 8, dtype)
        real = model.allocate_cache(8, dtype)
        assert (example.shape, example.dtype) == (real.shape, real.dtype)
    sharded = ShardedPagedLlama(PagedLlama(checkpoint.config, block_seq_stride=16), DeviceLayout(2, 1))
    assert [t.shape for t in example_cache(sharded, 8, torch.float32)] == [t.shape for t in sharded.allocate_cache(8)]
    before = _resident_mib()
    pages = (512 * 2**20) // (model.page_elems() * 4)  # half a GiB of cache
    held = example_cache(model, pages, torch.float32)
    assert held.numel() * 4 >= 500 * 2**20
    assert _resident_mib() - before < 32
