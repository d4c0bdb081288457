"""The sharded model in eager torch: every layout gives PagedLlama's hidden states through the
cache (prefill in two chunks, then decode), and its weights are the original's, cut."""

from __future__ import annotations

import pytest
import torch

from kiln.models.llama import PagedLlama
from kiln.models.sharded_llama import ShardedPagedLlama
from kiln.runtime.device_layout import DeviceLayout
from kiln.runtime.errors import ModelLoadError
from tests.hf_families import FAMILIES
from tests.tiny_model import make_tiny_checkpoint


def run(model, cache_dtype=torch.float32):
    tokens = list(range(10, 31))
    cache = model.allocate_cache(16, cache_dtype)
    table = torch.tensor([[3, 7, 2, 9]])
    with torch.no_grad():
        h1 = model.forward_paged(torch.tensor([tokens[:16]]), torch.tensor([0]), torch.tensor([16]), table[:, :2], cache)
        rest = torch.tensor([tokens[16:20] + [0] * 4])
        h2 = model.forward_paged(rest, torch.tensor([16]), torch.tensor([20]), table[:, :3], cache)
        h3 = model.forward_paged(torch.tensor([[tokens[20]]]), torch.tensor([20]), torch.tensor([21]), table[:, :3], cache)
        return torch.cat([model.logits(h1)[0], model.logits(h2)[0, :4], model.logits(h3)[0]])


@pytest.mark.parametrize("tp,pp,overrides", [
    (2, 1, {}), (1, 2, {}), (2, 2, {}),
    (2, 1, {"architecture": "qwen2", "attention_bias": True}),  # biases cut with their rows
    (1, 2, {"num_hidden_layers": 3}),  # uneven stages: layers 0-1, then 2
    (2, 3, {"num_hidden_layers": 3}),
])
def test_every_layout_gives_the_one_device_logits(tp, pp, overrides):
    checkpoint = make_tiny_checkpoint(seed=5, **overrides)

    def fresh():
        return PagedLlama(checkpoint.config, block_seq_stride=8).load_tensors(checkpoint.tensors).eval()

    want = run(fresh())
    sharded = ShardedPagedLlama(fresh(), DeviceLayout(tp, pp))
    assert len(sharded.allocate_cache(4)) == tp * pp
    got = run(sharded)
    assert (got - want).abs().max() / want.abs().max() < 1e-5


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_a_byte_cache_shards_to_the_one_device_logits(dtype):
    """Each device's byte pages keep their own scale blocks: the same quantized K and V, so the
    same logits as one device's byte cache."""
    checkpoint = make_tiny_checkpoint(seed=5, num_hidden_layers=3)

    def fresh():
        return PagedLlama(checkpoint.config, block_seq_stride=8).load_tensors(checkpoint.tensors).eval()

    want = run(fresh(), dtype)
    got = run(ShardedPagedLlama(fresh(), DeviceLayout(2, 3)), dtype)
    assert (got - want).abs().max() / want.abs().max() < 1e-5


def test_the_weights_are_the_originals_cut_not_copied_twice():
    checkpoint = make_tiny_checkpoint(seed=5)
    whole = PagedLlama(checkpoint.config).load_tensors(checkpoint.tensors)
    count = sum(p.numel() for p in whole.parameters())
    sharded = ShardedPagedLlama(PagedLlama(checkpoint.config).load_tensors(checkpoint.tensors), DeviceLayout(2, 2))
    assert sum(p.numel() for p in sharded.parameters()) == count
    q = whole.model.layers[1].self_attn.q_proj.weight
    rank1 = sharded.stages[1][0].attention[1].q_proj.weight
    assert torch.equal(rank1, q[q.shape[0] // 2:])


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_shards_to_the_one_device_logits(family, tmp_path):
    """Tensor and pipeline parallel over the families' departures: per-head QK-norms copied to
    every rank, sandwich norms after the reduce, sliding layers' masks and rotary on every device; a
    q/k norm over every head (OLMo's) refused across ranks, split over stages instead."""
    pytest.importorskip("transformers")
    from kiln.models.loader import load_hf_directory
    from tests.hf_families import write_family_checkpoint

    checkpoint = load_hf_directory(write_family_checkpoint(family, tmp_path))

    def fresh():
        return PagedLlama(checkpoint.config, block_seq_stride=8).load_tensors(checkpoint.tensors).eval()

    want = run(fresh())
    layout = DeviceLayout(2, 2)
    if checkpoint.config.qk_norm_whole:  # OLMo's norm over every head: pipeline parallel alone
        with pytest.raises(ModelLoadError, match="pipeline parallelism alone"):
            ShardedPagedLlama(fresh(), layout)
        layout = DeviceLayout(1, 2)
    got = run(ShardedPagedLlama(fresh(), layout))
    assert (got - want).abs().max() / want.abs().max() < 1e-5


def test_a_quantized_mixture_shards_to_the_one_device_logits(tmp_path):
    """A mixture quantized after its experts' columns are cut (as a tensor-parallel export does):
    Q8_0 blocks of 32 cut at a block edge are the whole expert's blocks, so each rank's experts are
    the one-device model's, held narrow on that rank's device."""
    pytest.importorskip("transformers")
    from iree.turbine.aot import DeviceTensorTrait

    from kiln.models.loader import load_hf_directory
    from kiln.models.quantize import quantize_model
    from kiln.models.quantized_experts import QuantizedExperts
    from tests.hf_families import write_family_checkpoint

    checkpoint = load_hf_directory(write_family_checkpoint("mixtral", tmp_path))

    def fresh():
        return PagedLlama(checkpoint.config, block_seq_stride=8).load_tensors(checkpoint.tensors).eval()

    want = run(quantize_model(fresh(), "q8_0"))
    sharded = quantize_model(ShardedPagedLlama(fresh(), DeviceLayout(2, 1)), "q8_0")
    experts = [m for m in sharded.modules() if isinstance(m, QuantizedExperts)]
    assert len(experts) == 2 * checkpoint.config.num_hidden_layers
    assert {DeviceTensorTrait.get(p).ordinal for m in experts for p in m.parameters()} == {0, 1}
    got = run(sharded)
    assert (got - want).abs().max() / want.abs().max() < 1e-5
