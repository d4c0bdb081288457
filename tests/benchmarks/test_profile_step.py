"""The step profiler: IREE's benchmark and profile tools over a compiled call of the tiny model."""

from __future__ import annotations

import json

import pytest

from benchmarks.profile_step import call_inputs, dispatch_times, main, profile
from kiln.runtime.config import load_model_config
from kiln.runtime.contract import Artifacts


def _row(name: str, samples: int, total_ns: int, row_type: str = "host_execution_function") -> dict:
    return {"row_type": row_type, "function_name": name, "sample_count": samples, "total_duration_ns": total_ns}


def test_dispatch_times_groups_each_computation_over_layers_and_divides_by_the_calls():
    rows = [
        _row("decode_bs1$async_dispatch_37_batch_matmul_1x1x576x1536_f32", 20, 4_000_000),
        _row("prefill_bs1$async_dispatch_3_batch_matmul_1x1x576x1536_f32", 20, 2_000_000),  # shared code
        _row("_encoding_29_encode_576xf32_to_576xf32", 40, 400_000),
        _row("decode_bs1$async_dispatch_9_elementwise_576_f32", 10, 1_000_000),
        _row(None, 3, 9_000_000, row_type="host_execution_command_buffer"),
    ]
    times = dispatch_times(rows, calls=10)
    assert times["kinds"] == [
        {"kind": "batch_matmul_1x1x576x1536_f32", "ms": pytest.approx(0.6), "count": 4.0},
        {"kind": "elementwise_576_f32", "ms": pytest.approx(0.1), "count": 1.0},
        {"kind": "encode_576xf32_to_576xf32", "ms": pytest.approx(0.04), "count": 4.0},
    ]
    assert times["dispatches"] == 9.0 and times["dispatch_ms"] == pytest.approx(0.74)


def test_inputs_follow_the_abi_and_give_each_row_its_own_pages(tiny_artifacts):
    params, _ = load_model_config(Artifacts.in_directory(tiny_artifacts).config)
    tokens, seq_lens, starts, table, cache = call_inputs(params, "decode_bs4", context=40, tokens=0)
    assert tokens.shape == (4, 1) and list(seq_lens) == [41] * 4 and list(starts) == [40] * 4
    assert table.shape == (4, 3) and sorted(table.ravel()) == list(range(1, 13))  # page 0 is padding's
    assert cache.shape == (13, params.page_elems)
    prefill = call_inputs(params, "prefill_bs1", context=0, tokens=32)
    assert prefill[0].shape == (1, 32) and prefill[-2].shape == (1, 2)
    for function, tokens in (("denoise_bs1", 32), ("prefill_bs1", 30), ("prefill_bs1", 4096), ("nope", 32),
                             ("decode_bs2", 32)):  # the tiny export decodes at 1 and 4
        with pytest.raises(SystemExit):
            call_inputs(params, function, context=10, tokens=tokens)


@pytest.mark.parametrize("function", ["decode_bs1", "prefill_bs1"])
def test_a_profile_of_the_tiny_model_counts_its_dispatches(tiny_artifacts, function):
    result = profile(tiny_artifacts, function, context=20, tokens=32, calls=2, repetitions=1)
    assert result["wall_ms"] > 0 and result["dispatch_ms"] > 0
    # Every dispatch runs once per call or more, in each of the two calls.
    assert result["dispatches"] >= 10 and all(kind["count"] >= 1 for kind in result["kinds"])
    assert any("matmul" in kind["kind"] for kind in result["kinds"])  # the weight and attention matmuls
    assert result["kinds"] == sorted(result["kinds"], key=lambda kind: -kind["ms"])


def test_the_command_prints_and_writes_its_figures(tiny_artifacts, tmp_path, capsys):
    out = tmp_path / "profile.json"
    assert main(["--artifacts", str(tiny_artifacts), "--context", "20", "--calls", "2", "--top", "3",
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("decode_bs1 of ") and "dispatches" in printed
    assert len(printed.splitlines()) == 3 + 3  # title, totals, header, three dispatches
    assert json.loads(out.read_text())["function"] == "decode_bs1"
    with pytest.raises(SystemExit) as refused:
        main(["--artifacts", str(tiny_artifacts), "--calls", "0"])
    assert refused.value.code == 2
    with pytest.raises(SystemExit) as refused:
        main(["--artifacts", str(tmp_path)])
    assert refused.value.code == 2
