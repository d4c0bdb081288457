"""benchmarks/synthetic_gguf.py's files (a model's shapes, random blocks) and benchmarks/scale_bench.py's
steps, on the tiny shapes and the tiny build."""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
import pytest
from tokenizers import Tokenizer

from benchmarks import scale_bench, synthetic_gguf
from kiln.models.default_model import default_model_path
from kiln.models.loader import load_checkpoint


@pytest.mark.parametrize("type_name", ["Q4_0", "Q8_0"])
def test_a_synthetic_file_loads_with_its_shapes_and_spread(tmp_path, type_name):
    shapes = synthetic_gguf.SHAPES["tiny"]
    path = synthetic_gguf.write(tmp_path / "tiny.gguf", shapes, type_name, log=lambda line: None)
    checkpoint = load_checkpoint(path)
    c = checkpoint.config
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (shapes.layers, shapes.hidden,
                                                                         shapes.intermediate)
    assert (c.num_attention_heads, c.num_key_value_heads, c.vocab_size) == (shapes.heads, shapes.kv_heads,
                                                                            shapes.vocab)
    assert c.rope_scaling["rope_type"] == "llama3" and c.rope_scaling["factor"] == pytest.approx(8.0)
    assert checkpoint.stored_quantization == type_name.lower()
    text = "def fibonacci(n): the capital of France"
    bundled = Tokenizer.from_str(load_checkpoint(default_model_path()).tokenizer_json).encode(text).ids
    assert Tokenizer.from_str(checkpoint.tokenizer_json).encode(text).ids == bundled
    up = checkpoint.tensors["model.layers.0.mlp.up_proj.weight"]
    assert up.shape == (shapes.intermediate, shapes.hidden)
    assert np.std(up) == pytest.approx(synthetic_gguf.WEIGHT_STD, rel=0.05)
    assert abs(float(np.mean(up))) < synthetic_gguf.WEIGHT_STD / 20
    np.testing.assert_array_equal(checkpoint.tensors["model.norm.weight"], np.ones(shapes.hidden, np.float32))


@pytest.mark.e2e
def test_the_scale_bench_measures_a_built_model_and_its_server(tiny_artifacts):
    done = scale_bench.run_watched([sys.executable, "-m", "benchmarks.scale_bench", "--measure", str(tiny_artifacts)])
    figures = json.loads(done["last_line"])
    assert done["seconds"] > 0 and done["peak_rss_mib"] >= done["peak_anon_mib"] > 0
    assert 0 < done["peak_pss_mib"] <= done["peak_rss_mib"]
    assert figures["load_s"] > 0 and figures["prefill_128_ms"] > 0 and figures["decode_bs1_tok_s"] > 0
    assert figures["parameters_mib"] == round((tiny_artifacts / "model.irpa").stat().st_size / 2**20)
    assert figures["target_mib"] == round(1.15 * (tiny_artifacts / "model.irpa").stat().st_size / 2**20 + 300)
    served = scale_bench.serve_ready(tiny_artifacts)
    assert served["health_s"] > 0 and served["rss_mib"] >= served["anon_mib"] > 0


def test_the_process_tree_takes_in_processes_started_from_any_thread():
    """A server starts its build from a thread of its own, which lives while the build runs: the tree
    (and its peak memory) holds the build. (Checked while the thread lives: once it exits, the kernel
    hands its children to another thread only after a join has already returned.)"""
    import subprocess
    import threading

    started, checked = [], threading.Event()

    def build():
        started.append(subprocess.Popen(["sleep", "30"]))
        checked.wait(30)

    thread = threading.Thread(target=build)
    thread.start()
    try:
        while not started:
            time.sleep(0.01)
        assert started[0].pid in scale_bench._tree(os.getpid())
    finally:
        checked.set()
        thread.join()
        started[0].kill()
        started[0].wait()


@pytest.mark.e2e
def test_a_first_serve_is_timed_from_an_empty_cache(tmp_path):
    from tests.tiny_model import make_tiny_checkpoint, write_hf_directory

    write_hf_directory(make_tiny_checkpoint(seed=5), tmp_path / "tiny")
    first = scale_bench.first_serve(tmp_path / "tiny")
    assert first["health_s"] > 0 and first["peak_rss_mib"] >= first["peak_anon_mib"] > 0
    assert first["peak_pss_mib"] > first["build_peak_pss_mib"] > 0
    assert any(step.startswith("wrote model.mlir in") for step in first["steps"])
    assert any(step.startswith("compiled model_cpu.vmfb") for step in first["steps"])
