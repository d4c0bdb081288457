"""export/trace_workers.py: functions shared out among forked tracing processes, each function's
module merged into one (a shared definition kept once, a clashing one renamed), a process's
failure reported with the functions it was tracing; the tiny model's module the same traced by
one process or by two."""

from __future__ import annotations

import os
import re

import pytest
import torch
from iree.compiler import ir

from kiln.export.trace_workers import merge_modules, trace_in_processes, tracing_processes, write_merged_module
from kiln.runtime.errors import ExportError

GLOBAL = 'util.global private @weight = #flow.parameter.named<"model"::"weight"> : tensor<4xf32>'


def module_text(function: str, helper_body: str = "%c = arith.constant 1 : i32") -> str:
    """A module as a tracing process writes one: a parameter's global, a private helper, a function."""
    return f"""module @module {{
  {GLOBAL}
  util.func private @helper() -> i32 {{
    {helper_body}
    util.return %c : i32
  }}
  util.func public @{function}() -> (tensor<4xf32>, i32) {{
    %w = util.global.load @weight : tensor<4xf32>
    %h = util.call @helper() : () -> i32
    util.return %w, %h : tensor<4xf32>, i32
  }}
}}
"""


def test_the_process_count_follows_the_cpus_or_the_setting(monkeypatch):
    monkeypatch.setenv("KILN_TRACE_JOBS", "3")
    assert tracing_processes(10) == 3 and tracing_processes(2) == 2
    monkeypatch.setenv("KILN_TRACE_JOBS", "0")
    assert tracing_processes(10) == 1
    monkeypatch.setenv("KILN_TRACE_JOBS", "many")
    with pytest.raises(ExportError, match="KILN_TRACE_JOBS"):
        tracing_processes(10)
    monkeypatch.delenv("KILN_TRACE_JOBS")
    assert tracing_processes(64) == len(os.sched_getaffinity(0))


def test_merged_modules_keep_one_copy_of_what_they_share(tmp_path):
    context = ir.Context()
    base = ir.Module.parse(module_text("first"), context).operation
    (tmp_path / "same.mlir").write_text(module_text("second"))
    (tmp_path / "clash.mlir").write_text(module_text("third", "%c = arith.constant 7 : i32"))
    merge_modules(base, [tmp_path / "same.mlir", tmp_path / "clash.mlir"])
    base.verify()
    text = str(base)
    assert text.count("util.global private @weight") == 1
    assert re.findall(r"util\.func public @(\w+)", text) == ["first", "second", "third"]
    # The third module's helper differs: kept under a new name, and the third function calls it.
    assert re.findall(r"util\.func private @(\w+)", text) == ["helper", "helper_clash"]
    third = text[text.index("@third"):]
    assert "util.call @helper_clash()" in third and "arith.constant 7" in text


def test_each_function_is_traced_in_a_process_of_its_own_and_the_modules_merge(tmp_path):
    seen = []

    def trace_share(share, log):
        for name in share:
            (tmp_path / f"{name}.mlir").write_text(module_text(name))
            (tmp_path / f"{name}.pid").write_text(str(os.getpid()))
            log(f"traced {name}")
        seen.append(list(share))  # reaches this process's list only if traced here

    lines = []
    trace_in_processes(trace_share, ["a", "b", "c", "d"], lambda name: {"c": 3.5}.get(name, 1.0), 2, tmp_path,
                       lines.append)
    assert seen == []
    assert sorted(lines) == ["traced a", "traced b", "traced c", "traced d"]
    pids = {(tmp_path / f"{name}.pid").read_text() for name in "abcd"}
    assert len(pids) == 4 and str(os.getpid()) not in pids
    write_merged_module([tmp_path / f"{name}.mlir" for name in "abcd"], tmp_path / "model.mlir")
    text = (tmp_path / "model.mlir").read_text()
    assert re.findall(r"util\.func public @(\w+)", text) == ["a", "b", "c", "d"]
    assert text.count("util.global private @weight") == 1 and text.count("util.func private @helper") == 1


def test_the_costliest_go_first_and_no_more_than_the_jobs_at_once(tmp_path):
    import time

    def trace_share(share, log):
        (tmp_path / f"{share[0]}.span").write_text(f"{time.monotonic()} ")
        time.sleep(0.3)
        with open(tmp_path / f"{share[0]}.span", "a") as span:
            span.write(str(time.monotonic()))

    costs = {"decode_bs1": 1.0, "prefill_bs1": 3.5, "decode_bs2": 1.0, "prefill_bs4": 3.5, "sample_bs1": 0.2}
    trace_in_processes(trace_share, list(costs), costs.get, 2, tmp_path, print)
    spans = {name: [float(t) for t in (tmp_path / f"{name}.span").read_text().split()] for name in costs}
    starts = sorted(spans, key=lambda name: spans[name][0])
    assert set(starts[:2]) == {"prefill_bs1", "prefill_bs4"} and starts[-1] == "sample_bs1"
    for name, (begin, _) in spans.items():  # at most two running whenever one starts
        assert sum(b <= begin < e for b, e in spans.values()) <= 2, name


def test_a_failed_process_names_its_functions(tmp_path):
    def trace_share(share, log):
        if "decode_bs4" in share:
            raise ValueError("an op the import cannot take")
        if "decode_bs8" in share:
            os.kill(os.getpid(), 9)

    with pytest.raises(ExportError, match=r"tracing decode_bs4: ValueError: an op the import cannot take"):
        trace_in_processes(trace_share, ["prefill_bs1", "decode_bs4"], lambda _: 1.0, 2, tmp_path, print)
    with pytest.raises(ExportError, match=r"tracing decode_bs8: the process was killed \(signal 9"):
        trace_in_processes(trace_share, ["prefill_bs1", "decode_bs8"], lambda _: 1.0, 2, tmp_path, print)


def test_after_a_failure_no_other_function_is_started(tmp_path):
    def trace_share(share, log):
        (tmp_path / f"{share[0]}.started").touch()
        if share[0] == "prefill_bs1":
            raise ValueError("no")

    with pytest.raises(ExportError, match="tracing prefill_bs1: ValueError: no"):
        trace_in_processes(trace_share, ["decode_bs1", "prefill_bs1", "decode_bs2"], lambda name: 3.5 if "prefill" in name else 1.0, 1,
                           tmp_path, print)
    assert sorted(p.stem for p in tmp_path.glob("*.started")) == ["prefill_bs1"]


def test_the_tiny_models_module_is_the_same_from_one_process_or_two(monkeypatch, tmp_path):
    from iree.turbine.aot import externalize_module_parameters

    from kiln.export import exporter
    from kiln.export.options import ExportOptions
    from kiln.models.llama import PagedLlama
    from tests.tiny_model import make_tiny_checkpoint

    checkpoint = make_tiny_checkpoint(seed=0)
    model = PagedLlama(checkpoint.config, block_seq_stride=16)
    model.load_tensors(checkpoint.tensors)
    externalize_module_parameters(model)  # as the export's are: named parameters, not constants
    options = ExportOptions(prefill_batch_sizes=(1, 2), decode_batch_sizes=(1, 2), max_seq_len=64,
                            device_block_count=8, decode_buckets=(64,)).validate(256)

    def functions(jobs: str) -> dict[str, str]:
        monkeypatch.setenv("KILN_TRACE_JOBS", jobs)
        with torch.no_grad():
            exporter.trace_module(model, options, tmp_path, tmp_path / "model.mlir", log=lambda line: None)
        text = (tmp_path / "model.mlir").read_text()
        # A constant's resource is renamed where a second module brings one of the same name.
        text = re.sub(r"dense_resource<([\w.]+?)(_\d+)?>", r"dense_resource<\1>", text.split("{-#")[0])
        parts = re.split(r"\n(?=  \S)", text)
        return {part.split("(")[0].strip(): part.strip() for part in parts[1:] if part.strip() != "}"}

    alone, shared = functions("1"), functions("2")
    assert alone == shared
    assert not [name for name in shared if "share" in name]  # nothing renamed: every global kept once
    assert {"func.func @prefill_bs2", "func.func @prefill_last_bs1", "func.func @decode_bs2_ctx64"} <= set(alone)
