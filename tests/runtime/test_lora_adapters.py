"""PEFT LoRA adapters read without torch and checked against a build's shapes; the adapter slots'
bookkeeping; the stacked weights the compiled functions will take."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from kiln.runtime.errors import InvalidRequestError, QueueFullError
from kiln.runtime.lora.adapter import LoraShapes, read_adapter
from kiln.runtime.safetensors_file import read_float_tensors
from kiln.runtime.lora.slots import LoraSlots
from kiln.runtime.lora.weights import StackedLoraWeights

SHAPES = LoraShapes(layers=2, max_rank=8, modules={"q_proj": (64, 64), "v_proj": (64, 32), "down_proj": (128, 64)})


def write_adapter(directory, rank=4, alpha=8, modules=("q_proj", "v_proj"), layers=(0, 1), seed=0, **config):
    """A random adapter in PEFT's on-disk format."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for layer in layers:
        for module in modules:
            fin, fout = SHAPES.modules.get(module, (64, 64))
            block = "mlp" if module.endswith(("gate_proj", "up_proj", "down_proj")) else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{key}.lora_A.weight"] = rng.normal(size=(rank, fin)).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = rng.normal(size=(fout, rank)).astype(np.float32)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(modules), "bias": "none",
         **config}))
    return tensors


def test_an_adapter_is_read_with_its_scale_folded_into_b(tmp_path):
    tensors = write_adapter(tmp_path / "a", rank=4, alpha=8)
    adapter = read_adapter("a", tmp_path / "a", SHAPES)
    assert (adapter.rank, adapter.scale, adapter.modules) == (4, 2.0, {"q_proj", "v_proj"})
    a, b = adapter.weights[(1, "v_proj")]
    key = "base_model.model.model.layers.1.self_attn.v_proj"
    np.testing.assert_array_equal(a, tensors[f"{key}.lora_A.weight"])
    np.testing.assert_allclose(b, 2.0 * tensors[f"{key}.lora_B.weight"])
    write_adapter(tmp_path / "rs", rank=4, alpha=8, use_rslora=True)
    assert read_adapter("rs", tmp_path / "rs", SHAPES).scale == pytest.approx(4.0)


def test_bf16_and_f16_files_read_as_float32(tmp_path):
    import struct

    values = np.array([1.5, -2.25, 0.0, 3.0], np.float32)
    bf16 = (values.view(np.uint32) >> 16).astype("<u2").tobytes()
    f16 = values.astype("<f2").tobytes()
    header = json.dumps({"x": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [0, 8]},
                         "y": {"dtype": "F16", "shape": [4], "data_offsets": [8, 16]}}).encode()
    path = tmp_path / "t.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bf16 + f16)
    read = read_float_tensors(path)
    np.testing.assert_array_equal(read["x"], values.reshape(2, 2))
    np.testing.assert_array_equal(read["y"], values)


@pytest.mark.parametrize("change, message", [
    (dict(rank=16), "rank 16, more than this server's --max-lora-rank 8"),
    (dict(modules=("k_proj",)), "adapts k_proj, which this build does not"),
    (dict(layers=(0, 5)), "adapts layer 5; the model has 2"),
    (dict(use_dora=True), "DoRA"),
    (dict(bias="all"), "trains biases"),
    (dict(modules_to_save=["lm_head"]), "replaces whole modules"),
    (dict(peft_type="IA3"), "is a IA3 adapter"),
    (dict(rank_pattern={"q_proj": 2}), "rank_pattern"),
])
def test_an_adapter_that_does_not_fit_is_refused_naming_why(tmp_path, change, message):
    write_adapter(tmp_path / "bad", **change)
    with pytest.raises(InvalidRequestError, match=message) as refused:
        read_adapter("bad", tmp_path / "bad", SHAPES)
    assert refused.value.param == "lora_path"


def test_missing_files_and_wrong_shapes_are_refused(tmp_path):
    with pytest.raises(InvalidRequestError, match="does not exist"):
        read_adapter("x", tmp_path / "nowhere", SHAPES)
    write_adapter(tmp_path / "nocfg")
    (tmp_path / "nocfg" / "adapter_config.json").unlink()
    with pytest.raises(InvalidRequestError, match="has no adapter_config.json"):
        read_adapter("x", tmp_path / "nocfg", SHAPES)
    write_adapter(tmp_path / "noweights")
    (tmp_path / "noweights" / "adapter_model.safetensors").unlink()
    with pytest.raises(InvalidRequestError, match="has no adapter_model.safetensors"):
        read_adapter("x", tmp_path / "noweights", SHAPES)
    write_adapter(tmp_path / "shape", modules=("down_proj",))
    config = json.loads((tmp_path / "shape" / "adapter_config.json").read_text())
    shapes = LoraShapes(2, 8, {"down_proj": (256, 64)})  # another model's MLP width
    with pytest.raises(InvalidRequestError, match=r"needs A \[4, 256\]"):
        read_adapter("x", tmp_path / "shape", shapes)
    assert config["r"] == 4
    (tmp_path / "shape" / "adapter_model.safetensors").write_bytes(b"not a file")
    with pytest.raises(InvalidRequestError, match="unreadable weights"):
        read_adapter("x", tmp_path / "shape", SHAPES)


def test_slots_fill_then_evict_the_least_recently_used_adapter_no_request_holds():
    slots = LoraSlots(2)
    assert slots.place("a") == (1, None) and slots.place("b") == (2, None)
    slots.hold("a")
    slots.hold("b")
    with pytest.raises(QueueFullError, match="--max-loras"):
        slots.place("c")
    slots.release("a")
    assert slots.place("c") == (1, "a") and slots.slot_of("a") is None
    slots.release("b")
    slots.hold("c")
    slots.release("c")  # c used after b: b goes first
    assert slots.place("d") == (2, "b")
    slots.hold("d")
    with pytest.raises(ValueError, match="in use"):
        slots.remove("d")
    slots.release("d")
    assert slots.remove("d") == 2 and slots.remove("d") is None


def test_stacked_weights_hold_each_slots_adapter_zero_padded(tmp_path):
    write_adapter(tmp_path / "a", rank=4, alpha=4)
    adapter = read_adapter("a", tmp_path / "a", SHAPES)
    weights = StackedLoraWeights(SHAPES, slots=2)
    weights.write(2, adapter)
    x = np.random.default_rng(1).normal(size=(3, 64)).astype(np.float32)
    a, b = adapter.weights[(0, "q_proj")]
    np.testing.assert_allclose(weights.delta(2, 0, "q_proj", x), (x @ a.T) @ b.T, rtol=1e-5, atol=1e-5)
    assert not weights.delta(0, 0, "q_proj", x).any() and not weights.delta(1, 0, "q_proj", x).any()
    assert not weights.delta(2, 0, "down_proj", np.ones((1, 128), np.float32)).any()  # not adapted
    weights.clear(2)
    assert not weights.delta(2, 0, "q_proj", x).any()
