"""Every bad input to the export CLIs: one clear error line, non-zero exit, nothing half-written."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_kiln
from tests.tiny_model import make_tiny_checkpoint, write_hf_directory


def assert_one_line_error(result, *needles):
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0], result.stderr


def assert_no_output(directory):
    assert not (directory / "model.json").exists()
    leftovers = [p.name for p in directory.parent.iterdir() if ".partial-" in p.name]
    assert not leftovers


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bad-input-hf")
    write_hf_directory(make_tiny_checkpoint(seed=0), directory)
    return directory


def export(model, out, *extra):
    return run_kiln("export-model", "--model", str(model), "--output-dir", str(out), *extra, check=False)


def test_missing_model(tmp_path):
    assert_one_line_error(export(tmp_path / "nope.gguf", tmp_path / "out"), "does not exist")
    assert_no_output(tmp_path / "out")


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    assert_one_line_error(export(bad, tmp_path / "out"), "bad.gguf")
    assert_no_output(tmp_path / "out")


def test_corrupt_safetensors(tmp_path, hf_dir):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(hf_dir, broken)
    (broken / "model.safetensors").write_bytes(b"\x00\x01not safetensors")
    assert_one_line_error(export(broken, tmp_path / "out"), "safetensors")
    assert_no_output(tmp_path / "out")


def test_unsupported_architecture(tmp_path, hf_dir):
    import shutil

    gpt2 = tmp_path / "gpt2"
    shutil.copytree(hf_dir, gpt2)
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": 2, "vocab_size": 384}
    (gpt2 / "config.json").write_text(json.dumps(config))
    assert_one_line_error(export(gpt2, tmp_path / "out"), "unsupported architecture", "GPT2LMHeadModel")
    assert_no_output(tmp_path / "out")


def test_stride_must_divide_max_seq_len(tmp_path, hf_dir):
    result = export(hf_dir, tmp_path / "out", "--block-seq-stride", "16", "--max-seq-len", "100")
    assert_one_line_error(result, "does not divide")
    assert_no_output(tmp_path / "out")


@pytest.mark.parametrize("flag,value", [("--bs-prefill", "0,4"), ("--bs-decode", "1,x"), ("--bs-decode", "-2")])
def test_batch_sizes_must_be_positive_integers(tmp_path, hf_dir, flag, value):
    assert_one_line_error(export(hf_dir, tmp_path / "out", f"{flag}={value}"), "positive integers")
    assert_no_output(tmp_path / "out")


def test_unknown_target(tmp_path):
    mlir = tmp_path / "model.mlir"
    mlir.write_text("module {}")
    result = run_kiln("compile-vmfb", str(mlir), "--target", "tpu", check=False)
    assert_one_line_error(result, "tpu")


def test_compile_of_invalid_mlir(tmp_path):
    mlir = tmp_path / "model.mlir"
    mlir.write_text("this is not MLIR")
    out = tmp_path / "model_cpu.vmfb"
    result = run_kiln("compile-vmfb", str(mlir), "--target", "cpu", "-o", str(out), check=False)
    assert_one_line_error(result, "iree-compile failed")
    assert not out.exists() and not list(tmp_path.glob("*.partial"))


@pytest.mark.parametrize("flags,needle", [
    (["--tensor-parallel", "3"], "--tensor-parallel 3 does not divide the model's 2 key/value heads"),
    (["--pipeline-parallel", "3"], "--pipeline-parallel 3 is more stages than the model's 2 layers"),
    (["--tensor-parallel", "0"], "expected a positive integer"),
])
def test_a_device_layout_the_model_cannot_take(hf_dir, tmp_path, flags, needle):
    assert_one_line_error(export(hf_dir, tmp_path / "out", *flags), needle)
    assert_no_output(tmp_path / "out")


@pytest.mark.parametrize("flags,needle", [
    (["--decode-buckets", "100"], "multiples of block_seq_stride 16"),
    (["--decode-buckets", "64,x"], "positive token counts"),
    (["--decode-buckets", "64", "--tensor-parallel", "2"], "one-device export"),
])
def test_decode_buckets_the_export_cannot_take(hf_dir, tmp_path, flags, needle):
    assert_one_line_error(export(hf_dir, tmp_path / "out", "--max-seq-len", "256", *flags), needle)
    assert_no_output(tmp_path / "out")


@pytest.mark.parametrize("flags,needle", [
    (["--top-k", "4"], "samples from raw logits: export without --top-k"),
    (["--logits-normalization", "softmax"], "samples from raw logits"),
    (["--tensor-parallel", "2"], "--sampling-functions applies to a one-device export"),
    (["--attention", "flash"], "invalid choice: 'flash'"),
])
def test_sampling_functions_and_attention_forms_the_export_cannot_take(hf_dir, tmp_path, flags, needle):
    assert_one_line_error(export(hf_dir, tmp_path / "out", "--sampling-functions", *flags), needle)
    assert_no_output(tmp_path / "out")
