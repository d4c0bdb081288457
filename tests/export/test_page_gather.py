"""The page gather custom op: eager torch indexing, and the compiled iree_linalg_ext.gather."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.export.page_gather import gather_pages
from kiln.models.llama import index_pages


def test_eager_gather_is_indexing():
    pages = torch.randn(10, 4, 8)
    index = torch.tensor([[[3, 0], [9, 9]], [[1, 2], [5, 7]]])
    out = gather_pages(pages, index)
    assert out.shape == (2, 2, 2, 4, 8)
    assert torch.equal(out, pages[index])
    assert torch.equal(out, index_pages(pages, index))  # the model's eager default computes the same


@pytest.mark.e2e
def test_compiled_gather_matches_indexing(tmp_path):
    """Dynamic page count and block count, as in decode: the op exports, compiles and runs."""
    from iree import runtime as ireert
    from iree.turbine import aot

    from kiln.export.compile import compile_vmfb

    class Gather(torch.nn.Module):
        def forward(self, cache, table):
            return gather_pages(cache.view(-1, 4, 8), table * 2 + 1)

    cache = torch.randn(6, 64)  # 6 pages of two [4, 8] blocks
    table = torch.tensor([[0, 2, 1], [2, 2, 0]])
    pages, blocks = torch.export.Dim("pages"), torch.export.Dim("blocks")
    exported = aot.export(Gather(), args=(cache, table), dynamic_shapes={"cache": {0: pages}, "table": {1: blocks}})
    mlir = tmp_path / "gather.mlir"
    exported.save_mlir(mlir)
    vmfb = tmp_path / "gather.vmfb"
    compile_vmfb(mlir, vmfb, "cpu", log=lambda line: None)

    module = ireert.load_vm_flatbuffer_file(str(vmfb), driver="local-task")
    bigger_cache = torch.randn(9, 64)
    longer_table = torch.tensor([[8, 0, 3, 5], [1, 1, 7, 2]])
    for c, t in ((cache, table), (bigger_cache, longer_table)):
        got = np.asarray(module.main(c.numpy(), t.numpy()))
        want = c.view(-1, 4, 8)[t * 2 + 1].numpy()
        np.testing.assert_array_equal(got, want)
