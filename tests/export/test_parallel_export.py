"""Tensor and pipeline parallelism on the tiny model over two local-task devices in one process.

The compiled TP = 2 and PP = 2 exports give the one-device export's logits (float32, within
1e-4 relative) and greedy tokens; each device loads only its share of the weights and holds
only its share of every KV page (the same bytes as the matching slice of a one-device page);
and the serving stack runs on them unchanged, the host KV tier included.
"""

from __future__ import annotations

import io

import numpy as np
import pytest

from kiln.export.placement import device_count, parameter_bytes_by_device
from kiln.runtime.contract import Artifacts
from kiln.runtime.devices import ShardedKvCache
from kiln.runtime.program import Program
from tests.paged_driver import PagedDriver, relative_error
from tests.runtime.test_host_tier_service import conversations, page_bytes_of
from tests.tiny_model import DEFAULT_CONFIG

pytestmark = pytest.mark.e2e

TOLERANCE = 1e-4
LAYERS, KV_HEADS, HEAD_DIM, STRIDE = 2, 2, 16, 16
PAGE_SHAPE = (LAYERS, 2, KV_HEADS, STRIDE * HEAD_DIM)  # one page of the one-device cache


def generate(program: Program, steps: int = 6) -> tuple[list[np.ndarray], list[list[int]], PagedDriver]:
    """Every logits array of a batch-4 prefill (three prompts, one padded row), greedy decode
    steps, a batch-1 decode and a prefill continuing at a start position; the greedy tokens."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(4, 384, n).tolist() for n in (5, 16, 37)]
    driver = PagedDriver(program)
    seqs = driver.new_sequences(3, 64)
    logits = [driver.prefill(seqs, prompts, batch=4)]
    sequences = [prompt + [int(logits[0][row, len(prompt) - 1].argmax())] for row, prompt in enumerate(prompts)]
    for _ in range(steps):
        step = driver.decode(seqs, [s[-1] for s in sequences], [len(s) - 1 for s in sequences], batch=4)
        logits.append(step)
        for row, sequence in enumerate(sequences):
            sequence.append(int(step[row, 0].argmax()))
    logits.append(driver.decode(driver.new_sequences(1, 16), [7], [0], batch=1))
    [continued] = driver.new_sequences(1, 48)
    prompt = rng.integers(4, 384, 40).tolist()
    driver.prefill([continued], [prompt[:32]], batch=1)
    logits.append(driver.prefill([continued], [prompt[32:]], batch=1, start_pos=[32], function="prefill_last"))
    return logits, sequences, driver


@pytest.fixture(scope="module")
def one_device(tiny_artifacts):
    return generate(Program(Artifacts.in_directory(tiny_artifacts)))


@pytest.fixture(scope="module", params=["tp2", "pp2"])
def parallel(request):
    artifacts = request.getfixturevalue(f"tiny_{request.param}_artifacts")
    program = Program(Artifacts.in_directory(artifacts))
    return request.param, artifacts, program, generate(program)


def test_logits_and_greedy_tokens_match_one_device(parallel, one_device):
    _, _, program, (logits, tokens, _) = parallel
    want_logits, want_tokens, _ = one_device
    assert len(program.devices) == 2 and program.devices[0] is not program.devices[1]
    for got, want in zip(logits, want_logits, strict=True):
        rows = min(len(got), 3)  # the padded fourth row of a batch-4 call is not compared
        assert relative_error(got[:rows], want[:rows]) < TOLERANCE
    assert tokens == want_tokens


def test_each_device_holds_its_share_of_every_kv_page(parallel, one_device):
    """Device d's page p is exactly the part of a one-device page p that d's layers and heads own
    (page 0 left out: padding rows all write there, in no set order)."""
    kind, _, _, (_, _, driver) = parallel
    cache = driver.cache
    assert isinstance(cache, ShardedKvCache)
    one = np.asarray(one_device[2].cache.to_host())
    pages = one.reshape(one.shape[0], *PAGE_SHAPE)
    if kind == "tp2":  # rank r: every layer, K/V head r
        shares = [pages[:, :, :, rank : rank + 1] for rank in range(2)]
    else:  # stage s: layer s, every head
        shares = [pages[:, stage : stage + 1] for stage in range(2)]
    for buffer, share in zip(cache.buffers, shares, strict=True):
        got = np.asarray(buffer.to_host())
        assert got.shape == (one.shape[0], one.shape[1] // 2)
        np.testing.assert_allclose(got[1:], share.reshape(one.shape[0], -1)[1:], rtol=1e-4, atol=1e-5)
    used = np.abs(pages).sum(axis=(1, 2, 3, 4)) > 0
    assert used.sum() > 10  # the comparison covered real pages


def _decode_ms(program: Program, pages: int) -> float:
    from tests.paged_driver import call_ms

    cache = program.allocate_cache(pages)
    return call_ms(program, "decode_bs1", (np.array([[3]]), np.array([21]), np.array([20]), np.array([[1, 2]]), cache),
                   repeats=30)


def test_every_devices_cache_is_updated_in_place(parallel):
    """As test_tiny_e2e's one-device check: a copy of each buffer per call would make a 64x larger
    cache many times slower (it did, with device 0's buffer given an explicit affinity)."""
    _, _, program, _ = parallel
    small, large = _decode_ms(program, 64), _decode_ms(program, 64 * 64)
    assert large < 3 * small + 0.5, f"decode {small:.2f} ms at 64 pages, {large:.2f} ms at 4096 pages"


def test_each_device_loads_its_share_of_the_weights(parallel, tiny_artifacts):
    kind, artifacts, _, _ = parallel
    text = (artifacts / "model.mlir").read_text()
    assert device_count(text) == 2
    from iree.compiler import ir

    with ir.Context():  # compile-vmfb reads the count from a module given as bytecode too
        bytecode = io.BytesIO()
        ir.Module.parse(text).operation.write_bytecode(bytecode)
    assert device_count(bytecode.getvalue().decode("latin-1")) == 2
    split = parameter_bytes_by_device(text)
    [whole] = parameter_bytes_by_device((tiny_artifacts / "model.mlir").read_text()).values()
    assert sum(split.values()) == whole  # nothing loaded twice
    c = DEFAULT_CONFIG
    hidden, inter, heads = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"]
    attention = hidden * heads * HEAD_DIM * 2 + hidden * KV_HEADS * HEAD_DIM * 2  # q, o; k, v
    mlp = 3 * hidden * inter
    if kind == "tp2":  # device 1: half of every layer's attention and MLP; device 0 the rest
        assert split[1] == LAYERS * (attention + mlp) // 2 * 4
    else:  # device 1: the second layer, norms included
        assert split[1] == (attention + mlp + 2 * hidden) * 4


def test_the_serving_stack_runs_unchanged_with_the_host_tier(parallel, tiny_artifacts):
    """Multi-turn conversations through GenerateService (trie prefix cache, host KV tier whose
    page copies span both devices' buffers): the one-device export's greedy tokens."""
    _, artifacts, _, _ = parallel
    want, _, _ = conversations(artifacts=tiny_artifacts)
    page_bytes = page_bytes_of(artifacts)
    got, stats, _ = conversations(artifacts=artifacts, host_kv_bytes=4 * 24 * page_bytes)
    assert got == want
    assert stats.host_hit_tokens > 0


@pytest.mark.parametrize("target,arch,driver", [("cuda", "sm_80", "cuda"), ("rocm", "gfx942", "hip")])
def test_gpu_targets_compile_for_two_devices(tiny_tp2_artifacts, tmp_path, target, arch, driver):
    from kiln.export.compile import target_flags
    from tests.conftest import run_kiln

    assert target_flags(target, arch, 2)[:2] == [f"--iree-hal-target-device={driver}[0]",
                                                  f"--iree-hal-target-device={driver}[1]"]
    out = tmp_path / f"model_{target}.vmfb"
    result = run_kiln("compile-vmfb", str(tiny_tp2_artifacts / "model.mlir"), "--target", target, "--arch", arch,
                      "-o", str(out))
    # prefill, prefill_last (bs 1, 4), decode (bs 1, 4): each with both devices' caches consumed
    assert "marked 12 cache argument(s)" in result.stderr and "2 devices" in result.stderr
    assert out.stat().st_size > 10_000


def test_arguments_pinned_to_device_zero_when_the_affinity_analysis_needs_it(tiny_tp2_artifacts, tmp_path):
    """compile-vmfb's fallback for deep tensor-parallel modules: every import and write-back of an
    argument names its device (device 1's keep theirs; device 0's get one)."""
    import re
    import subprocess

    from iree.compiler import ir

    from kiln.export.compile import iree_compile_tool, pin_arguments_to_first_device

    subprocess.run([iree_compile_tool(), str(tiny_tp2_artifacts / "model.mlir"), "--compile-to=input",
                    "-o", str(tmp_path / "input.mlir")], check=True)
    before = (tmp_path / "input.mlir").read_text()
    with ir.Context():
        module = ir.Module.parse(before)
        pin_arguments_to_first_device(module)
        after = str(module)
    ops = re.findall(r"hal\.tensor\.(?:import|alias)( on\(#hal\.device\.promise<@__device_(\d)>\))?", after)
    assert ops and all(on for on, _ in ops)
    assert sorted({device for _, device in ops}) == ["0", "1"]
    assert before.count("@__device_1>) wait") == after.count("@__device_1>) wait")
