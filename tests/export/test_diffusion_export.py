"""A diffusion LM through export → compile → iree.runtime: denoise_bs<N> against the torch model."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kiln.export.export_model import build_model, with_decode_buckets
from kiln.export.options import ExportOptions
from kiln.models.loader import load_checkpoint
from kiln.runtime.contract import Artifacts
from kiln.runtime.errors import ExportError
from kiln.runtime.diffusion.commit import confidence
from kiln.runtime.program import Program
from tests.conftest import run_kiln
from tests.diffusion_model import MASK_ID
from tests.paged_driver import call_ms, relative_error

pytestmark = pytest.mark.e2e
TOLERANCE = 1e-4


@pytest.fixture(scope="module", params=["llada", "dream"])
def exported(request):
    """(the compiled program, the torch model of the same checkpoint) for each format."""
    artifacts = request.getfixturevalue(f"tiny_{request.param}_artifacts")
    checkpoint = load_checkpoint(request.getfixturevalue(f"tiny_{request.param}_hf"))
    model = build_model(checkpoint, ExportOptions().validate(256))
    return Program(Artifacts.in_directory(artifacts)), model


def torch_logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model.forward_reference(torch.tensor([list(tokens)])).numpy()[0]


def denoise(program, cache, rows, starts, visible, pages, batch):
    """Call denoise_bs<batch> on rows of equal width; padding rows see one token on page 0."""
    width = max(len(r) for r in rows)
    tokens = np.zeros((batch, width), np.int64)
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = row
    seq_lens = np.ones(batch, np.int64)
    seq_lens[: len(rows)] = visible
    start = np.zeros(batch, np.int64)
    start[: len(rows)] = starts
    table = np.zeros((batch, max(len(p) for p in pages)), np.int64)
    for i, row_pages in enumerate(pages):
        table[i, : len(row_pages)] = row_pages
    return program.invoke(f"denoise_bs{batch}", tokens, start, seq_lens, table, cache)[0]


def test_the_config_records_the_model_kind(tiny_llada_artifacts, tiny_dream_artifacts):
    for artifacts, shift in ((tiny_llada_artifacts, 0), (tiny_dream_artifacts, 1)):
        kiln = json.loads((artifacts / "model.kiln.json").read_text())
        assert kiln["model_kind"] == "diffusion" and kiln["logits_shift"] == shift
        assert kiln["mask_token_id"] == 4 and kiln["denoise_batch_sizes"] == [1, 4]
        shortfin = json.loads((artifacts / "model.json").read_text())
        assert shortfin["prefill_batch_sizes"] == [] and shortfin["decode_batch_sizes"] == []
        assert kiln["denoise_top"] is True
        functions = Program(Artifacts.in_directory(artifacts)).functions.keys()
        assert functions == {"denoise_bs1", "denoise_bs4", "denoise_top_bs1", "denoise_top_bs4"}
        assert kiln["decode_buckets"] == []


def test_decode_buckets_are_refused_for_a_diffusion_lm(tiny_llada_hf):
    checkpoint = load_checkpoint(tiny_llada_hf)
    with pytest.raises(ExportError, match="no decode functions"):
        with_decode_buckets(checkpoint, ExportOptions(decode_buckets=(256,)).validate(256))
    assert with_decode_buckets(checkpoint, ExportOptions(cpu_kernels=True).validate(256)).decode_buckets == ()


def test_a_full_pass_is_the_bidirectional_forward(exported):
    program, model = exported
    cache = program.allocate_cache(64)
    tokens = np.random.default_rng(0).integers(5, 384, 45).tolist()
    logits = denoise(program, cache, [tokens], [0], [45], [[1, 2, 3]], batch=1)
    assert relative_error(logits[0], torch_logits(model, tokens)) < TOLERANCE


def test_rows_of_different_lengths_in_one_call(exported):
    """Whole-sequence rows padded at their end (the padding is written to page 0, never read)."""
    program, model = exported
    cache = program.allocate_cache(64)
    rng = np.random.default_rng(1)
    rows = [rng.integers(5, 384, n).tolist() for n in (40, 33, 47)]
    logits = denoise(program, cache, rows, [0, 0, 0], [40, 33, 47], [[1, 2, 3], [4, 5, 6], [7, 8, 9]], batch=4)
    for i, row in enumerate(rows):
        assert relative_error(logits[i, : len(row)], torch_logits(model, row)) < TOLERANCE


def test_cached_windows_right_after_a_refresh_equal_the_full_pass(exported):
    """Fast-dLLM's dual cache (a block attending to cached prefix and suffix) and prefix cache
    (from the block on): straight after the refresh pass, the window's logits are the full pass's."""
    program, model = exported
    cache = program.allocate_cache(64)
    tokens = np.random.default_rng(2).integers(5, 384, 50).tolist()
    full = denoise(program, cache, [tokens], [0], [50], [[1, 2, 3, 4]], batch=1)[0]
    dual = denoise(program, cache, [tokens[20:37]], [20], [50], [[1, 2, 3, 4]], batch=1)[0]
    assert relative_error(dual, full[20:37]) < TOLERANCE
    prefix = denoise(program, cache, [tokens[20:]], [20], [50], [[1, 2, 3, 4]], batch=1)[0]
    assert relative_error(prefix, full[20:]) < TOLERANCE
    # A changed block sees the cached rest: it differs from the old logits, but only there.
    changed = tokens[:20] + [7] * 17 + tokens[37:]
    window = denoise(program, cache, [changed[20:37]], [20], [50], [[1, 2, 3, 4]], batch=1)[0]
    assert relative_error(window, full[20:37]) > 1e-2


def test_the_greedy_summary_is_what_the_commit_rules_read_from_the_logits(exported):
    """denoise_top: per position the best token (the mask left out), its probability, the
    runner-up's and the negative entropy, as runtime.diffusion.commit computes them in float64."""
    program, model = exported
    cache = program.allocate_cache(64)
    tokens = np.random.default_rng(4).integers(5, 384, 41).tolist()
    args = ([tokens], [0], [41], [[1, 2, 3]])
    logits = denoise(program, cache, *args, batch=1)[0].copy()
    summary = program.invoke("denoise_top_bs1", np.array(args[0]), np.array(args[1]), np.array(args[2]),
                             np.array(args[3]), cache)[0][0]
    logits[:, MASK_ID] = -np.inf
    best = logits.argmax(-1)
    assert np.array_equal(summary[:, 0].astype(int), best)
    for measure, column in (("top1", summary[:, 1]), ("margin", summary[:, 1] - summary[:, 2]),
                            ("entropy", summary[:, 3])):
        np.testing.assert_allclose(column, confidence(logits, best, measure), atol=1e-5)


@pytest.mark.parametrize("target,arch", [("cuda", "sm_80"), ("rocm", "gfx942")])
def test_gpu_targets_compile_denoise_in_place(tiny_llada_artifacts, tmp_path, target, arch):
    out = tmp_path / f"model_{target}.vmfb"
    result = run_kiln("compile-vmfb", str(tiny_llada_artifacts / "model.mlir"), "--target", target, "--arch", arch,
                      "-o", str(out))
    assert "marked 4 cache argument(s)" in result.stderr  # denoise and denoise_top, bs 1 and 4
    assert out.stat().st_size > 10_000


def _denoise_ms(program: Program, pages: int) -> float:
    cache = program.allocate_cache(pages)
    return call_ms(program, "denoise_bs1", (np.full((1, 20), 5), np.array([0]), np.array([20]), np.array([[1, 2]]),
                                            cache))


def test_denoise_updates_the_cache_in_place(tiny_llada_artifacts):
    """As for prefill and decode: a full-cache copy per call would make a 64x larger cache far slower."""
    program = Program(Artifacts.in_directory(tiny_llada_artifacts))
    small, large = _denoise_ms(program, 64), _denoise_ms(program, 64 * 64)
    assert large < 3 * small + 0.5, f"denoise {small:.2f} ms at 64 pages, {large:.2f} ms at 4096 pages"
