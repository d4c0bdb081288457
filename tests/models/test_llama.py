"""The torch model against Hugging Face transformers, and its paged path against its plain one."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from kiln.models.loader import load_hf_directory
from kiln.models.llama import PagedLlama
from tests.tiny_model import make_tiny_checkpoint, write_hf_directory


def transformers_logits(directory, tokens):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), torch_dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].numpy()


def ours(checkpoint, tokens):
    model = PagedLlama(checkpoint.config).load_tensors(checkpoint.tensors).eval()
    with torch.no_grad():
        return model.forward_reference(torch.tensor([tokens])).numpy()[0]


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"tie_word_embeddings": True},
        {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
        {"architecture": "qwen2", "attention_bias": True},
    ],
    ids=["llama", "tied", "llama3-rope", "qwen2-bias"],
)
def test_matches_transformers(tmp_path, overrides):
    checkpoint = make_tiny_checkpoint(seed=3, **overrides)
    write_hf_directory(checkpoint, tmp_path)
    tokens = list(range(5, 45))
    loaded = load_hf_directory(tmp_path)
    want = transformers_logits(tmp_path, tokens)
    got = ours(loaded, tokens)
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-5


def test_sharded_directory_loads_the_same_tensors(tmp_path):
    checkpoint = make_tiny_checkpoint(seed=4)
    write_hf_directory(checkpoint, tmp_path / "one")
    write_hf_directory(checkpoint, tmp_path / "two", shards=2)
    one, two = load_hf_directory(tmp_path / "one"), load_hf_directory(tmp_path / "two")
    assert one.tensors.keys() == two.tensors.keys()
    for name in one.tensors:
        np.testing.assert_array_equal(one.tensors[name], two.tensors[name])


@pytest.mark.parametrize("overrides", [{}, {"architecture": "qwen2", "attention_bias": True}], ids=["llama", "qwen2-bias"])
def test_paged_path_equals_plain_path_in_torch(overrides):
    """Prefill in two chunks, then decode (its Q/K/V one fused matmul), through the cache, in eager torch."""
    checkpoint = make_tiny_checkpoint(seed=5, **overrides)
    model = PagedLlama(checkpoint.config, block_seq_stride=8).load_tensors(checkpoint.tensors).eval()
    tokens = list(range(10, 31))
    cache = model.allocate_cache(16)
    table = torch.tensor([[3, 7, 2, 9]])
    with torch.no_grad():
        want = model.forward_reference(torch.tensor([tokens]))[0]
        first = torch.tensor([tokens[:16]])
        h1 = model.forward_paged(first, torch.tensor([0]), torch.tensor([16]), table[:, :2], cache)
        rest = torch.tensor([tokens[16:20] + [0] * 4])  # padded to a page; padding goes to page 0
        h2 = model.forward_paged(rest, torch.tensor([16]), torch.tensor([20]), table[:, :3], cache)
        h3 = model.forward_paged(torch.tensor([[tokens[20]]]), torch.tensor([20]), torch.tensor([21]), table[:, :3], cache)
        got = torch.cat([model.logits(h1)[0], model.logits(h2)[0, :4], model.logits(h3)[0]])
    assert (got - want).abs().max() / want.abs().max() < 1e-5


def test_the_model_imports_without_iree_turbine():
    """The plain-torch model needs no iree-turbine: the export supplies the page-gather op."""
    code = ("import sys; sys.modules['iree.turbine'] = None\n"
            "import kiln.models.llama, kiln.models.loader\n"
            "assert not any(name.startswith('iree.turbine') and sys.modules[name] for name in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
