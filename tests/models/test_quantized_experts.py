"""A mixture's stacked experts stored narrow (models/quantized_experts.py): each expert exactly the
weight a dense layer of the same mode holds, the mixture's output that of its widened weights, a
GGUF's expert blocks taken as stored, and the bytes a quantized mixture holds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.models.config import LlamaConfig
from kiln.models.llama import Experts, SparseMoE
from kiln.models.loader import load_checkpoint, load_hf_directory
from kiln.models.quantize import QuantizedWeight, quantize_model
from kiln.models.quantized_experts import PROJECTIONS, QuantizedExperts

from tests.hf_families import write_family_checkpoint

MODES = ["bf16", "int8", "q8_0", "q4_0", "q4_1"]


def mixture(seed: int = 0, intermediate: int = 64) -> SparseMoE:
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=intermediate)
    torch.manual_seed(seed)
    moe = SparseMoE(config)
    with torch.no_grad():
        for parameter in moe.parameters():
            parameter.copy_(torch.randn_like(parameter) * parameter.shape[-1] ** -0.5)
        moe.gate.weight.mul_(8.0)  # routing far from ties, as a trained router's
    return moe.eval()


@pytest.mark.parametrize("intermediate", [64, 48], ids=["blocks", "rows"])
@pytest.mark.parametrize("mode", MODES)
def test_each_expert_is_stored_as_a_dense_weight_of_its_mode_is(mode, intermediate):
    """Expert j of a projection widens to exactly what QuantizedWeight makes of that expert's own
    [N, K] weight; 4-bit values are held two a byte; a down projection whose K (48) is no multiple
    of 32 falls back to int8 rows, as a dense one does."""
    moe = mixture(intermediate=intermediate)
    floats = {name: getattr(moe.experts, name).detach().clone() for name in PROJECTIONS}
    quantize_model(moe, mode)
    experts = moe.experts
    assert isinstance(experts, QuantizedExperts) and type(moe.gate).__name__ == "Router"  # the router stays float
    index = torch.tensor([[2, 0], [3, 3]])
    for name in PROJECTIONS:
        every = experts.every(name, torch.float32)
        for j in range(floats[name].shape[0]):
            dense = QuantizedWeight(floats[name][j], mode)
            assert torch.equal(every[j], dense.dequantized()), (name, j)
        assert torch.equal(experts.chosen(name, index, torch.float32), every[index])
        values = getattr(experts, name)
        packed = mode in ("q4_0", "q4_1") and floats[name].shape[-1] % 32 == 0
        assert experts.packed[name] == packed
        assert values.dtype == (torch.bfloat16 if mode == "bf16" else torch.int8)
        assert values.shape[-1] == floats[name].shape[-1] // (2 if packed else 1)


@pytest.mark.parametrize("mode", MODES)
def test_a_quantized_mixture_computes_with_its_widened_weights(mode):
    """Decode (one token a row: each token's chosen experts gathered) and prefill (every expert)
    give the output of the same mixture holding the widened weights in float32."""
    moe = mixture(seed=1)
    quantize_model(moe, mode)
    widened = mixture(seed=1)
    with torch.no_grad():
        for name in PROJECTIONS:
            setattr(widened.experts, name, torch.nn.Parameter(moe.experts.every(name, torch.float32)))
        widened.gate.weight.copy_(moe.gate.weight)
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        for tokens in (x[:, :1], x):
            torch.testing.assert_close(moe(tokens), widened(tokens), rtol=1e-5, atol=1e-5)


def _kernel_matmul():
    """A model's matmul whose kernel takes block experts where they lie (the CPU kernels' own op,
    in its eager arithmetic)."""
    from kiln.export.cpu_kernels import experts_blocks
    from kiln.models.quantize import eager_weight_matmul

    def matmul(*args):
        return eager_weight_matmul(*args)

    matmul.experts_blocks = experts_blocks
    return matmul


@pytest.mark.parametrize("intermediate", [64, 48], ids=["blocks", "rows"])
@pytest.mark.parametrize("mode", ["q4_0", "q4_1", "q8_0", "int8", "bf16"])
def test_block_experts_are_read_in_place_where_the_kernel_takes_them(mode, intermediate):
    """Given a kernel for experts in place, a block-quantized mixture sends each token and its k
    chosen experts there, in a decode step and a prefill alike (its input quantized per block of
    32, as a dense layer's in a decode step): each token's output is its experts' kernel products,
    weighed by the routing, and near the widened weights' float output. Experts it cannot take (a
    down projection of 48 columns, held as int8 rows of no whole blocks) keep the float path's
    exact output."""
    from kiln.export.cpu_kernels import eager_rows_blocks
    from kiln.models.quantize import blocks_of_input, unpack_nibbles

    moe = mixture(seed=3, intermediate=intermediate)
    quantize_model(moe, mode, _kernel_matmul())
    experts = moe.experts
    assert experts.reads_in_place == (mode != "bf16" and intermediate % 32 == 0)
    widened = mixture(seed=3, intermediate=intermediate)
    with torch.no_grad():
        for name in PROJECTIONS:
            setattr(widened.experts, name, torch.nn.Parameter(experts.every(name, torch.float32)))
        widened.gate.weight.copy_(moe.gate.weight)

    def product(name, row, expert):
        q, xs, xsum = blocks_of_input(row.view(1, -1))
        values, scale, offset = (getattr(experts, f"{name}{part}") for part in ("", "_scale", "_offset"))
        values = unpack_nibbles(values[expert]) if experts.packed[name] else values[expert]
        return eager_rows_blocks(q, xs, values, scale[expert], None if offset is None else xsum,
                                 None if offset is None else offset[expert])[0]

    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        for tokens in (x[:, :1], x):  # a decode step's, a prefill's
            got, float_out = moe(tokens), widened(tokens)
            if not experts.reads_in_place:
                torch.testing.assert_close(got, float_out, rtol=1e-5, atol=1e-5)
                continue
            assert (got - float_out).norm() / float_out.norm() < 2e-2  # int8 inputs per block of 32
            rows = tokens.reshape(-1, 64)
            weights, chosen = moe.routing(rows)
            for t in range(rows.shape[0]):
                want = torch.zeros(64)
                for weight, expert in zip(weights[t].tolist(), chosen[t].tolist()):
                    gate, up = product("gate_proj", rows[t], expert), product("up_proj", rows[t], expert)
                    want += weight * product("down_proj", torch.nn.functional.silu(gate) * up, expert)
                torch.testing.assert_close(got.reshape(-1, 64)[t], want, rtol=1e-5, atol=1e-5)


def test_a_gguf_mixtures_expert_blocks_are_served_as_stored(tmp_path):
    """A Q4_0 Mixtral GGUF's [E, rows, K] expert tensors: the export holds their values (as
    nibbles two a byte) and float16 scales as the file stores them, and widens them to gguf-py's
    dequantization of the file, exactly."""
    from gguf import GGMLQuantizationType, GGUFReader, quants

    from kiln.export.export_model import build_model
    from kiln.export.options import ExportOptions
    from kiln.models.gguf_loader import hf_tensor_name
    from kiln.models.gguf_writer import write_gguf

    directory = write_family_checkpoint("mixtral", tmp_path / "hf")
    path = write_gguf(load_hf_directory(directory), tmp_path / "mixtral-q4_0.gguf", dtype="q4_0")
    checkpoint = load_checkpoint(path)
    assert checkpoint.stored_quantization == "q4_0"
    model = build_model(checkpoint, ExportOptions().validate(256, checkpoint.stored_quantization))
    checked = 0
    for tensor in GGUFReader(path).tensors:
        if len(tensor.shape) != 3:
            continue
        assert tensor.tensor_type.name == "Q4_0"
        experts, _, name = hf_tensor_name(tensor.name).rpartition(".")
        module = model.get_submodule(experts)
        e, n, k = (int(d) for d in reversed(tensor.shape.tolist()))
        floats = quants.dequantize(np.asarray(tensor.data), GGMLQuantizationType.Q4_0).reshape(e, n, k)
        assert torch.equal(module.every(name, torch.float32), torch.from_numpy(floats)), tensor.name
        blocks = np.asarray(tensor.data).view(np.uint8).reshape(e, n, k // 32, 18)
        scales = blocks[..., :2].copy().view(np.float16)[..., 0]  # [E, N, K / 32]
        assert (getattr(module, f"{name}_scale").numpy() == scales.transpose(0, 2, 1)).all()
        assert module.packed[name] and getattr(module, name).shape == (e, n, k // 2)
        checked += 1
    assert checked == 3 * checkpoint.config.num_hidden_layers


def test_a_quantized_mixture_holds_its_experts_in_their_modes_bytes(tmp_path):
    """The tiny Mixtral's experts are most of its weights: at the default Q4_1 they hold 5/8 of a
    byte a weight (values two a byte, a float32 scale and offset per 32), not float32's 4."""
    from kiln.export.export_model import build_model
    from kiln.export.options import ExportOptions

    checkpoint = load_hf_directory(write_family_checkpoint("mixtral", tmp_path / "hf"))
    model = build_model(checkpoint, ExportOptions(quantize="q4_1").validate(256))
    c = checkpoint.config
    weights = 3 * c.num_experts * c.intermediate_size * c.hidden_size * c.num_hidden_layers
    held = sum(p.numel() * p.element_size() for name, p in model.named_parameters() if ".experts." in name)
    assert held == weights // 2 + 2 * 4 * weights // 32
    assert not [m for m in model.modules() if isinstance(m, Experts)]
