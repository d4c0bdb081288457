"""The GPU benchmark's parts that run anywhere: the parameter manifest read from a module, the
synthetic values (the same bits on every machine), a module run on parameters written from
its manifest, and the PyTorch peer built from a config alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks import gpu_bench

MODULE_TEXT = """
  util.global private @__auto.a = #flow.parameter.named<"model"::"model.norm.weight"> : tensor<576xf32>
  util.global private @__auto.b = #flow.parameter.named<"model"::"lm_head.weight"> : tensor<49152x576xbf16>
"""


def test_manifest_lists_each_parameter_with_its_shape_and_element_type():
    assert gpu_bench.parameter_manifest(MODULE_TEXT) == [
        {"name": "model.norm.weight", "shape": [576], "element": "f32"},
        {"name": "lm_head.weight", "shape": [49152, 576], "element": "bf16"},
    ]


def test_manifest_refuses_element_types_it_cannot_fill():
    text = '#flow.parameter.named<"model"::"q.weight"> : tensor<8x32xi8>'
    with pytest.raises(SystemExit, match="q.weight: synthetic values for i8"):
        gpu_bench.parameter_manifest(text)


def test_synthetic_values_are_pinned():
    # The GPU run compares its tokens with ones recorded on another machine from these values:
    # a change here must be deliberate (and the references rebuilt).
    values = gpu_bench.synthetic_values("model.layers.0.mlp.up_proj.weight", [2, 3], "f32")
    assert values.dtype == np.float32 and values.shape == (2, 3)
    assert np.array_equal(values, gpu_bench.synthetic_values("model.layers.0.mlp.up_proj.weight", [2, 3], "f32"))
    assert np.all(np.abs(values) < 0.05)
    norm = gpu_bench.synthetic_values("model.norm.weight", [64], "f32")
    assert np.all((norm >= 0.9) & (norm < 1.1))
    bf16 = gpu_bench.synthetic_values("model.layers.0.mlp.up_proj.weight", [2, 3], "bf16")
    assert bf16.dtype == np.uint16
    assert np.array_equal(bf16, (values.view(np.uint32) >> 16).astype(np.uint16))
    assert values.ravel()[:3].tolist() == [0.0019436180591583252, 0.04694029316306114, -0.008961833082139492]


def test_a_module_runs_on_parameters_written_from_its_manifest(tiny_artifacts, tmp_path):
    manifest = gpu_bench.parameter_manifest((tiny_artifacts / "model.mlir").read_text())
    assert len(manifest) > 5
    for file in ("model_cpu.vmfb", *gpu_bench.MODEL_FILES):
        (tmp_path / file).symlink_to(tiny_artifacts / file)
    gpu_bench.write_parameters(manifest, tmp_path / "model.irpa")
    artifacts = gpu_bench._artifacts(tmp_path, "cpu")
    first = gpu_bench.greedy_tokens(artifacts, "local-task")
    assert len(first) == gpu_bench.PARITY_PROMPTS
    assert all(len(tokens) == gpu_bench.PARITY_TOKENS for tokens in first)
    assert gpu_bench.greedy_tokens(artifacts, "local-task") == first


def test_torch_peer_builds_a_model_from_a_config_alone(tiny_hf_dir, tmp_path):
    (tmp_path / "config.json").write_text((tiny_hf_dir / "config.json").read_text())
    script = Path(gpu_bench.__file__).with_name("peers") / "transformers_bench.py"
    done = subprocess.run([sys.executable, str(script), "offline", str(tmp_path), "--random-weights"],
                          check=True, stdout=subprocess.PIPE, text=True, timeout=600)
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["device"] == "cpu" and figures["torch_dtype"] == "float32"
    assert figures["decode_bs1_tok_s"] > 0 and figures["prefill_512_ms"] > 0


def test_report_puts_kiln_over_torch():
    figures = {"decode_bs1_tok_s": 100.0, "decode_bs8_tok_s": 400.0, "prefill_128_ms": 2.0, "prefill_512_ms": 4.0}
    slower = {"decode_bs1_tok_s": 50.0, "decode_bs8_tok_s": 400.0, "prefill_128_ms": 4.0, "prefill_512_ms": 4.0}
    fixed = {"bs1": {"fixed": "decode_bs1_ctx256", "fixed_ms": 1.5, "dynamic_ms": 6.0, "speedup": 4.0}}
    table = gpu_bench.report({"precisions": {"f32": {"kiln": figures, "torch": slower, "fixed_decode": fixed}}})
    assert "| f32 | kiln / torch | 2.00x | 1.00x | 2.00x | 1.00x |" in table
    assert "| f32 | 1 | 1.50 | 6.00 | 4.00x |" in table


def test_report_has_torch_compile_host_sampling_a_variant_and_the_serving_figures():
    figures = {"decode_bs1_tok_s": 100.0, "decode_bs8_tok_s": 400.0, "prefill_128_ms": 2.0, "prefill_512_ms": 4.0}
    compiled = {"decode_bs1_tok_s": 200.0, "decode_bs8_tok_s": 800.0}
    load = {"output_throughput": 600.0, "p50_ttft_ms": 20.0, "p99_ttft_ms": 30.0, "p50_itl_ms": 9.0,
            "p99_itl_ms": 12.0, "failed": 0}
    table = gpu_bench.report({
        "precisions": {"bf16": {"kiln": figures, "kiln_host_sampling": {**figures, "decode_bs1_tok_s": 90.0},
                                "torch": figures,
                                "torch_compiled": compiled},
                       "bf16-graphs": {"kiln": figures, "device_flags": ["--cuda_use_streams=false"]},
                       "f32": {"error": "exit status 1", "torch": figures}},
        "serving": {"precision": "bf16", "input_tokens": 256, "output_tokens": 128, "c16": load}})
    assert "| bf16 | kiln / torch.compile | 0.50x | 0.50x | | |" in table
    assert "| bf16 | kiln_host_sampling | 90.0 | 400.0 | 2.00 | 4.00 |" in table
    assert "| bf16-graphs | kiln | 100.0 | 400.0 | 2.00 | 4.00 |" in table
    assert "| f32 | kiln | exit status 1 | | | |" in table
    assert "| 16 | 600.0 | 20.0 | 30.0 | 9.00 | 12.00 | 0 |" in table


def test_a_package_that_fails_to_measure_is_reported_not_raised(tmp_path):
    entry = gpu_bench.measure_in_child(tmp_path / "missing", "local-task", timeout=120)
    assert entry == {"error": "exit status 1"}
