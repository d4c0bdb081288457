"""Decode attention reading the KV pages in place (export/cpu_attention.py): the kernel compiled
alone and run through iree.runtime against the model's own gather path (whole pages copied by
index, batch matmuls and the blocked softmax of `Attention.attend_paged`) at several batch sizes
and context lengths, with pages out of order, padding rows and a page past the cache's end; its
eager twin against the same; and which exports take it.

Tolerance: float32, the sums in another order (and the softmax online rather than blocked), 1e-5
relative to the output's scale.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.export import cpu_attention, cpu_kernels
from kiln.export.compile import run_iree_compile, target_flags
from kiln.export.export_model import build_model
from kiln.export.options import ExportOptions
from kiln.models.config import LlamaConfig
from kiln.models import kv_quant
from kiln.models.llama import MASKED_SCORE, Attention, index_pages
from kiln.runtime.config import KV_SCALE_BYTES, kv_scale_blocks

pytestmark = pytest.mark.skipif(cpu_kernels.support_problem() is not None, reason=str(cpu_kernels.support_problem()))


def _compile_alone(directory, rows: int, heads: int, kv_heads: int, head_dim: int, stride: int,
                   byte_page: tuple[int, int] | None = None, fmt: str = "int8"):
    """The kernel's dispatch behind a public function of q, the K pages (float32, or bytes of
    format `fmt` with pages of `byte_page` blocks), the page table and the visible counts, compiled
    as an export's would be."""
    import iree.runtime as rt

    name = f"kiln_paged_decode_attention_{rows}x{heads}x{kv_heads}x{head_dim}x{stride}"
    kernel = cpu_attention.FLOAT_KERNEL_SYMBOL if byte_page is None else cpu_attention.BYTE_KERNEL_SYMBOLS[fmt]
    body = cpu_attention._decode_attention_text(name, rows, heads, kv_heads, head_dim, stride, byte_page,
                                                kernel).strip()
    q_type = f"tensor<{rows}x{heads}x{head_dim}xf32>"
    pages_type = f"tensor<?x{head_dim}x{stride}x{'f32' if byte_page is None else 'i8'}>"
    table_type, visible_type = f"tensor<{rows}x{kv_heads}x?xi64>", f"tensor<{rows}xi64>"
    source = directory / "attention.mlir"
    source.write_text(f"""{body[:-1]}
util.func public @main(%q: {q_type}, %key_pages: {pages_type}, %pages: {table_type}, %visible: {visible_type})
    -> {q_type} {{
  %out = util.call @{name}(%q, %key_pages, %pages, %visible)
      : ({q_type}, {pages_type}, {table_type}, {visible_type}) -> {q_type}
  util.return %out : {q_type}
}}
}}""")
    cpu_kernels.build_object(directory)
    run_iree_compile([str(source), *target_flags("cpu"), f"--iree-hal-executable-object-search-path={directory}",
                      "-o", str(directory / "attention.vmfb")], "compiling the attention kernel")
    context = rt.SystemContext(config=rt.Config("local-task"))
    context.add_vm_module(rt.VmModule.copy_buffer(context.instance, (directory / "attention.vmfb").read_bytes()))
    return context.modules.module.main


def _gather_path(q, key_pages, table, visible, heads: int, stride: int, value_pages=None):
    """The model's decode attention without the kernel: pages copied by index, then
    `Attention.attend_paged` with the bias `PagedStep` builds, its output projection the identity.
    V pages are the K pages' buffer viewed [stride, D] unless given."""
    rows, _, head_dim = q.shape
    kv_heads, blocks = table.shape[1], table.shape[2]
    config = LlamaConfig(vocab_size=8, hidden_size=heads * head_dim, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, rms_norm_eps=1e-5,
                         rope_theta=1e4, max_position_embeddings=blocks * stride)
    attention = Attention(config)
    with torch.no_grad():
        attention.o_proj.weight.copy_(torch.eye(heads * head_dim))
    value_pages = key_pages.view(-1, stride, head_dim) if value_pages is None else value_pages
    keys_t = index_pages(key_pages, table).permute(0, 1, 3, 2, 4).reshape(rows, kv_heads, head_dim, blocks * stride)
    values = index_pages(value_pages, table + kv_heads).view(rows, kv_heads, blocks * stride, head_dim)
    hidden = (torch.arange(blocks * stride).view(1, -1) >= visible.view(-1, 1)).float()
    bias = (hidden * MASKED_SCORE).view(rows, 1, 1, blocks * stride)
    # attend_paged scales q itself; the kernel takes it scaled.
    with torch.no_grad():
        out = attention.attend_paged(q.unsqueeze(2) * np.sqrt(head_dim), keys_t, values, bias, stride)
    return out.view(rows, heads, head_dim)


def _case(rows: int, heads: int, kv_heads: int, head_dim: int, stride: int, contexts: list[int], seed: int):
    """Random K/V pages and queries; each row's blocks on pages drawn out of order from the whole
    cache (a K page and its V page kv_heads later, as the model lays a layer out), padding rows
    (context 0) pointing at page 0."""
    rng = np.random.default_rng(seed)
    blocks = max(1, -(-max(contexts) // stride))
    units = 2 * kv_heads  # K and V pages of one layer's heads per cache page
    cache_pages = rows * blocks + 3
    key_pages = torch.from_numpy(rng.standard_normal((cache_pages * units, head_dim, stride)).astype(np.float32))
    order = rng.permutation(np.arange(1, cache_pages))
    table = np.zeros((rows, kv_heads, blocks), np.int64)
    for row in range(rows):
        if contexts[row]:
            pages = order[row * blocks:(row + 1) * blocks]
            table[row] = pages.reshape(1, -1) * units + np.arange(kv_heads).reshape(-1, 1)
    q = torch.from_numpy(rng.standard_normal((rows, heads, head_dim)).astype(np.float32)) / np.sqrt(head_dim)
    return q, key_pages, torch.from_numpy(table), torch.tensor(contexts, dtype=torch.int64)


CASES = [
    # rows, heads, kv_heads, head_dim, stride, each row's context (0: a padding row)
    (1, 9, 3, 64, 16, [1]),
    (1, 9, 3, 64, 16, [129]),
    (3, 9, 3, 64, 16, [17, 0, 48]),
    (8, 9, 3, 64, 16, [5, 16, 31, 200, 0, 64, 1, 99]),
    (4, 4, 2, 16, 32, [33, 7, 0, 64]),
    (2, 8, 8, 128, 16, [300, 15]),
    (2, 8, 2, 32, 16, [70, 33]),  # a group of 4 (Llama 3, Gemma 3)
    (1, 10, 1, 16, 16, [40]),  # a group past the AVX2 build's constant ones
]


@pytest.mark.e2e
@pytest.mark.parametrize("rows,heads,kv_heads,head_dim,stride,contexts", CASES)
def test_the_kernel_matches_the_gather_path(tmp_path, rows, heads, kv_heads, head_dim, stride, contexts):
    main = _compile_alone(tmp_path, rows, heads, kv_heads, head_dim, stride)
    q, key_pages, table, visible = _case(rows, heads, kv_heads, head_dim, stride, contexts, seed=sum(contexts))
    got = np.asarray(main(q.numpy(), key_pages.numpy(), table.numpy(), visible.numpy()))
    want = _gather_path(q, key_pages, table, visible, heads, stride).numpy()
    live = np.asarray(contexts) > 0
    np.testing.assert_allclose(got[live], want[live], rtol=1e-5, atol=1e-5)
    # A padding row sees no key: its output is 0 (the gather path's is an average of page 0).
    assert not got[~live].any()


@pytest.mark.e2e
def test_a_page_past_the_end_of_the_cache_is_never_read(tmp_path):
    """A corrupt page table must not read outside the cache: that block's keys are skipped."""
    main = _compile_alone(tmp_path, 1, 4, 2, 16, 16)
    q, key_pages, table, visible = _case(1, 4, 2, 16, 16, [32], seed=5)
    table[0, :, 1] = key_pages.shape[0] + 1000
    got = np.asarray(main(q.numpy(), key_pages.numpy(), table.numpy(), visible.numpy()))
    want = _gather_path(q, key_pages, table[:, :, :1], torch.tensor([16]), 4, 16).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows,heads,kv_heads,head_dim,stride,contexts", CASES)
def test_the_eager_twin_matches_the_gather_path(rows, heads, kv_heads, head_dim, stride, contexts):
    q, key_pages, table, visible = _case(rows, heads, kv_heads, head_dim, stride, contexts, seed=len(contexts))
    got = cpu_attention.eager_decode_attention(q, key_pages, table, visible)
    want = _gather_path(q, key_pages, table, visible, heads, stride)
    live = visible > 0
    torch.testing.assert_close(got[live], want[live], rtol=1e-5, atol=1e-5)
    assert not got[~live].any()


def _byte_case(rows: int, heads: int, kv_heads: int, head_dim: int, stride: int, contexts: list[int], seed: int,
               fmt: str = "int8"):
    """_case for a byte cache of format `fmt` laid out as the model lays one layer out: pages of 2 *
    kv_heads value blocks then their scale blocks; random values over the format's whole range
    (every e4m3 byte but its NaNs, subnormals included) and a random scale per key. Returns q, the
    K pages [X, D, stride] as int8 bytes, the table, visible counts and the page shape (blocks a
    page, value blocks)."""
    rng = np.random.default_rng(seed)
    blocks = max(1, -(-max(contexts) // stride))
    value_blocks = 2 * kv_heads
    page_blocks = value_blocks + kv_scale_blocks(value_blocks, head_dim, fmt)
    cache_pages = rows * blocks + 3
    shape = (cache_pages * page_blocks, head_dim, stride)
    if fmt == "int8":
        key_pages = rng.integers(-127, 128, shape).astype(np.int8)
    else:
        key_pages = rng.integers(-128, 127, shape).astype(np.int8)
        key_pages[key_pages == -1] = 0  # 0x7f and 0xff are e4m3's NaNs
    scale_rows = key_pages.reshape(cache_pages, -1, KV_SCALE_BYTES * stride)[:, value_blocks * head_dim // 2:]
    # Scales that bound |K|, |V| by 0.1..6 in either format, as the float cases' values are.
    largest = torch.from_numpy(rng.uniform(0.1, 6.0, (cache_pages, scale_rows.shape[1], stride)).astype(np.float32))
    code = kv_quant.encode_scale(largest, kv_quant.QMAX[fmt])
    scale_rows[:] = kv_quant.code_bytes(code).view(cache_pages, -1, 2 * stride).numpy()
    order = rng.permutation(np.arange(1, cache_pages))
    table = np.zeros((rows, kv_heads, blocks), np.int64)
    for row in range(rows):
        if contexts[row]:
            pages = order[row * blocks:(row + 1) * blocks]
            table[row] = pages.reshape(1, -1) * page_blocks + np.arange(kv_heads).reshape(-1, 1)
    q = torch.from_numpy(rng.standard_normal((rows, heads, head_dim)).astype(np.float32)) / np.sqrt(head_dim)
    return (q, torch.from_numpy(key_pages), torch.from_numpy(table), torch.tensor(contexts, dtype=torch.int64),
            (page_blocks, value_blocks))


@pytest.mark.e2e
@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("rows,heads,kv_heads,head_dim,stride,contexts", CASES[1:4] + CASES[5:])
def test_the_byte_kernel_matches_the_gather_path_over_dequantized_pages(tmp_path, rows, heads, kv_heads, head_dim,
                                                                       stride, contexts, fmt):
    """A byte cache's kernel against the float gather path over the same pages dequantized (each
    value block read as K^T [D, stride] and as V [stride, D], its scales per key either way), and
    the op's eager twin against the same."""
    q, key_pages, table, visible, page = _byte_case(rows, heads, kv_heads, head_dim, stride, contexts,
                                                    seed=sum(contexts), fmt=fmt)
    main = _compile_alone(tmp_path, rows, heads, kv_heads, head_dim, stride, page, fmt)
    got = np.asarray(main(q.numpy(), key_pages.numpy(), table.numpy(), visible.numpy()))
    keys, values = cpu_attention.dequantized_pages(key_pages, *page, fmt)
    want = _gather_path(q, keys, table, visible, heads, stride, values).numpy()
    live = np.asarray(contexts) > 0
    np.testing.assert_allclose(got[live], want[live], rtol=1e-5, atol=1e-5)
    assert not got[~live].any()
    eager = cpu_attention.KERNELS[fmt](q, key_pages, table, visible, *page).numpy()
    np.testing.assert_allclose(eager[live], want[live], rtol=1e-5, atol=1e-5)


@pytest.mark.e2e
def test_the_byte_kernel_never_reads_a_scale_block_as_values(tmp_path):
    """A corrupt table naming a scale block (or a K block whose V block would be one) skips those
    keys, as a page past the end of the cache is skipped."""
    q, key_pages, table, visible, page = _byte_case(1, 4, 2, 16, 16, [32], seed=9)
    main = _compile_alone(tmp_path, 1, 4, 2, 16, 16, page)
    want = np.asarray(main(q.numpy(), key_pages.numpy(), table[:, :, :1].numpy(), torch.tensor([16]).numpy()))
    for local in (page[1] - 1, page[1]):  # V would be a scale block; a scale block itself
        table[0, :, 1] = table[0, :, 1] // page[0] * page[0] + local
        got = np.asarray(main(q.numpy(), key_pages.numpy(), table.numpy(), visible.numpy()))
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_exports_with_the_kernels_take_it_where_the_cache_is_float32_or_bytes(tiny_checkpoint):
    def decode_attention(**options):
        return build_model(tiny_checkpoint, ExportOptions(**options).validate(256)).decode_attention

    assert decode_attention(cpu_kernels=True) is cpu_attention.paged_decode_attention
    assert decode_attention(cpu_kernels=True, kv_cache_dtype="int8") is cpu_attention.paged_decode_attention_int8
    assert (decode_attention(cpu_kernels=True, kv_cache_dtype="fp8_e4m3")
            is cpu_attention.paged_decode_attention_fp8_e4m3)
    assert decode_attention(cpu_kernels=True, kv_cache_dtype="float16") is None
    assert decode_attention(cpu_kernels=False) is None
    config = tiny_checkpoint.config
    assert not cpu_attention.supports(config, 8, "float32")  # half a vector of keys a page
