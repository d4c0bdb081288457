"""LLaDA and Dream checkpoints, in their upstream formats, load to the logits of their own math.

The yardstick is a plain torch forward written here over the tensors as upstream names them,
read straight from the safetensors files: no Kiln code between the files and it.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from kiln.models.diffusion_loader import llada_tensors
from kiln.models.llama import PagedLlama
from kiln.models.loader import load_checkpoint
from kiln.runtime.errors import ModelLoadError
from tests.diffusion_model import MASK_ID, MASK_TOKEN, write_tiny_dream, write_tiny_llada
from tests.tiny_model import EOS_ID, IM_END_ID

# Upstream tensor and config.json names, per format: LLaDA's OLMo names, Dream's Qwen2 ones.
LLADA = dict(
    embed="model.transformer.wte.weight", final_norm="model.transformer.ln_f.weight",
    head="model.transformer.ff_out.weight", block="model.transformer.blocks.{}.",
    attn_norm="attn_norm", q="q_proj", k="k_proj", v="v_proj", o="attn_out",
    ff_norm="ff_norm", gate="ff_proj", up="up_proj", down="ff_out",
    heads="n_heads", kv_heads="n_kv_heads", layers="n_layers", tied="weight_tying",
)
DREAM = dict(
    embed="model.embed_tokens.weight", final_norm="model.norm.weight",
    head="lm_head.weight", block="model.layers.{}.",
    attn_norm="input_layernorm", q="self_attn.q_proj", k="self_attn.k_proj", v="self_attn.v_proj",
    o="self_attn.o_proj", ff_norm="post_attention_layernorm", gate="mlp.gate_proj", up="mlp.up_proj",
    down="mlp.down_proj", heads="num_attention_heads", kv_heads="num_key_value_heads",
    layers="num_hidden_layers", tied="tie_word_embeddings",
)
FORMATS = {"llada": (write_tiny_llada, LLADA), "dream": (write_tiny_dream, DREAM)}
TOKENS = [0, 5, 40, 41, 200, MASK_ID, MASK_ID, 77, MASK_ID, 383, 1, 3, MASK_ID, 9, 120, 250]


def upstream_tensors(directory) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors |= {name: t.float() for name, t in load_file(str(path)).items()}
    return tensors


def upstream_logits(directory, names: dict, tokens: list[int]) -> np.ndarray:
    """Embeddings; per block RMSNorm, q/k/v (+bias), rotary, attention over every position,
    output, residual, RMSNorm, silu(gate) * up, down, residual; final norm; output head."""
    config = json.loads((directory / "config.json").read_text())
    w = upstream_tensors(directory)
    heads, kv_heads = config[names["heads"]], config[names["kv_heads"]]
    eps, theta = config["rms_norm_eps"], config["rope_theta"]

    def norm(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    def linear(x, name):
        return x @ w[name + ".weight"].T + w.get(name + ".bias", 0)

    def rotary(x):  # [heads, T, D]: pairs (i, i + D/2) turn by position * theta^(-2i/D)
        t, d = x.shape[-2:]
        angle = torch.arange(t, dtype=torch.float64)[:, None] * theta ** (-torch.arange(0, d, 2) / d)
        cos, sin = angle.cos().float(), angle.sin().float()
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    h = w[names["embed"]][torch.tensor(tokens)]
    t = len(tokens)
    for i in range(config[names["layers"]]):
        p = names["block"].format(i)
        x = norm(h, w[p + names["attn_norm"] + ".weight"])
        q = rotary(linear(x, p + names["q"]).view(t, heads, -1).transpose(0, 1))
        k = rotary(linear(x, p + names["k"]).view(t, kv_heads, -1).transpose(0, 1))
        v = linear(x, p + names["v"]).view(t, kv_heads, -1).transpose(0, 1)
        kv_of_head = torch.arange(heads) // (heads // kv_heads)
        scores = q @ k[kv_of_head].transpose(1, 2) / math.sqrt(q.shape[-1])
        attended = (scores.softmax(-1) @ v[kv_of_head]).transpose(0, 1).reshape(t, -1)
        h = h + linear(attended, p + names["o"])
        x = norm(h, w[p + names["ff_norm"] + ".weight"])
        h = h + linear(torch.nn.functional.silu(linear(x, p + names["gate"])) * linear(x, p + names["up"]),
                       p + names["down"])
    head = w[names["embed"]] if config[names["tied"]] else w[names["head"]]
    return (norm(h, w[names["final_norm"]]) @ head.T).numpy()


def kiln_logits(directory, tokens=TOKENS) -> np.ndarray:
    checkpoint = load_checkpoint(directory)
    model = PagedLlama(checkpoint.config).load_tensors(checkpoint.tensors).eval()
    with torch.no_grad():
        return model.forward_reference(torch.tensor([tokens]))[0].numpy()


def relative_error(got, want) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


def rewrite_config(directory, drop=(), **changes):
    path = directory / "config.json"
    values = {k: v for k, v in json.loads(path.read_text()).items() if k not in drop}
    path.write_text(json.dumps(values | changes))
    return directory


@pytest.mark.parametrize(
    "kind, options",
    [
        ("llada", {}),
        ("llada", {"weight_tying": True}),
        ("llada", {"include_qkv_bias": True}),
        ("llada", {"embedding_size": 512}),
        ("dream", {}),
        ("dream", {"tie_word_embeddings": True}),
    ],
    ids=["llada", "llada-tied", "llada-qkv-bias", "llada-padded-embeddings", "dream", "dream-tied"],
)
def test_loads_to_the_upstream_logits(tmp_path, kind, options):
    write, names = FORMATS[kind]
    directory = write(tmp_path, seed=2, **options)
    want = upstream_logits(directory, names, TOKENS)
    assert relative_error(kiln_logits(directory), want) < 1e-4


def test_llada_config_and_tokenizer(tmp_path):
    checkpoint = load_checkpoint(write_tiny_llada(tmp_path))
    c = checkpoint.config
    assert (c.architecture, c.model_kind, c.is_diffusion) == ("llada", "diffusion", True)
    assert (c.mask_token_id, c.logits_shift, c.attention_bias) == (MASK_ID, 0, False)
    assert c.eos_token_ids == [EOS_ID, IM_END_ID]  # </s> from config.json, <|im_end|> from generation_config
    assert c.max_position_embeddings == 256 and c.intermediate_size == 128 and c.num_key_value_heads == 2
    assert "lm_head.weight" in checkpoint.tensors and not c.tie_word_embeddings
    assert Tokenizer.from_str(checkpoint.tokenizer_json).token_to_id(MASK_TOKEN) == MASK_ID
    assert "chat_template" in checkpoint.tokenizer_config
    assert all(t.dtype == np.float32 for t in checkpoint.tensors.values())


def test_dream_config(tmp_path):
    c = load_checkpoint(write_tiny_dream(tmp_path)).config
    assert (c.architecture, c.model_kind, c.is_diffusion) == ("dream", "diffusion", True)
    assert (c.mask_token_id, c.logits_shift) == (MASK_ID, 1)
    assert c.attention_bias and c.eos_token_ids == [EOS_ID]


def test_weight_tying_llada_has_no_output_matrix(tmp_path):
    checkpoint = load_checkpoint(write_tiny_llada(tmp_path, weight_tying=True))
    assert "model.transformer.ff_out.weight" not in upstream_tensors(tmp_path)
    assert checkpoint.config.tie_word_embeddings and "lm_head.weight" not in checkpoint.tensors
    assert PagedLlama(checkpoint.config).lm_head is None


def test_padded_embeddings_set_the_vocabulary(tmp_path):
    checkpoint = load_checkpoint(write_tiny_llada(tmp_path, embedding_size=512))
    assert checkpoint.config.vocab_size == 512
    assert checkpoint.tensors["model.embed_tokens.weight"].shape == (512, 64)


@pytest.mark.parametrize("kind", ["llada", "dream"])
def test_sharded_and_bfloat16_checkpoints(tmp_path, kind):
    write = FORMATS[kind][0]
    one = load_checkpoint(write(tmp_path / "one", seed=5))
    sharded = load_checkpoint(write(tmp_path / "sharded", seed=5, shards=3))
    bf16 = load_checkpoint(write(tmp_path / "bf16", seed=5, shards=2, dtype="bfloat16"))
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) == 3
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    assert one.tensors.keys() == sharded.tensors.keys() == bf16.tensors.keys()
    rounded = {}
    for name, tensor in one.tensors.items():
        np.testing.assert_array_equal(sharded.tensors[name], tensor)
        rounded[name] = torch.from_numpy(tensor).bfloat16().float().numpy()
        np.testing.assert_array_equal(bf16.tensors[name], rounded[name])
        assert bf16.tensors[name].dtype == np.float32
    model = PagedLlama(one.config).load_tensors(rounded).eval()
    with torch.no_grad():
        want = model.forward_reference(torch.tensor([TOKENS]))[0].numpy()
    got = kiln_logits(tmp_path / "bf16")
    assert relative_error(got, want) < 1e-5
    assert relative_error(got, kiln_logits(tmp_path / "one")) < 5e-2  # what bf16 weights cost


def assert_one_line_error(error: pytest.ExceptionInfo, *words: str):
    message = str(error.value)
    assert "\n" not in message and all(word in message for word in words), message


@pytest.mark.parametrize(
    "overrides, words",
    [
        ({"alibi": True}, ["alibi=True"]),
        ({"block_type": "sequential"}, ["block_type='sequential'", "'llama'"]),
        ({"include_bias": True}, ["include_bias=True"]),
        ({"activation_type": "swiglu"}, ["activation_type='swiglu'"]),
        ({"rope": False}, ["rope=False"]),
        ({"layer_norm_type": "default"}, ["layer_norm_type='default'"]),
        ({"scale_logits": True}, ["scale_logits=True"]),
        ({"block_group_size": 2}, ["block_group_size=2"]),
        ({"multi_query_attention": True}, ["multi_query_attention=True"]),
    ],
)
def test_unsupported_llada_flags_are_named(tmp_path, overrides, words):
    with pytest.raises(ModelLoadError) as error:
        load_checkpoint(write_tiny_llada(tmp_path, **overrides))
    assert_one_line_error(error, "LLaDA", *words)


def test_absent_llada_flag_takes_the_upstream_default(tmp_path):
    directory = rewrite_config(write_tiny_llada(tmp_path), drop=["block_type"])
    with pytest.raises(ModelLoadError) as error:
        load_checkpoint(directory)
    assert_one_line_error(error, "block_type", "sequential")


def test_unsupported_dream_activation_is_named(tmp_path):
    with pytest.raises(ModelLoadError) as error:
        load_checkpoint(write_tiny_dream(tmp_path, hidden_act="gelu"))
    assert_one_line_error(error, "Dream", "hidden_act='gelu'")


@pytest.mark.parametrize(
    "changes, drop, words",
    [
        ({"model_type": "mamba"}, ["architectures"], ["model_type", "mamba", "LLaDAModelLM", "DreamModel"]),
        ({"architectures": ["FooForMaskedLM"], "model_type": "foo"}, [], ["architectures", "FooForMaskedLM"]),
    ],
)
def test_unknown_model_type_is_named(tmp_path, changes, drop, words):
    directory = rewrite_config(write_tiny_llada(tmp_path), drop=drop, **changes)
    with pytest.raises(ModelLoadError) as error:
        load_checkpoint(directory)
    assert_one_line_error(error, "unsupported architecture", *words)


@pytest.mark.parametrize(
    "kind, drop, words",
    [
        ("llada", ["d_model", "n_layers"], ["LLaDA", "d_model", "n_layers"]),
        ("dream", ["hidden_size"], ["hidden_size"]),
        # upstream's default mask ids lie past this vocabulary
        ("llada", ["mask_token_id"], ["mask_token_id=126336", "384"]),
        ("dream", ["mask_token_id"], ["mask_token_id=151666"]),
    ],
)
def test_missing_fields_are_named(tmp_path, kind, drop, words):
    directory = rewrite_config(FORMATS[kind][0](tmp_path), drop=drop)
    with pytest.raises(ModelLoadError) as error:
        load_checkpoint(directory)
    assert_one_line_error(error, *words)


def test_null_mask_token_is_refused(tmp_path):
    directory = rewrite_config(write_tiny_dream(tmp_path), mask_token_id=None)
    with pytest.raises(ModelLoadError) as error:
        load_checkpoint(directory)
    assert_one_line_error(error, "mask_token_id=None", "mask token")


def test_the_family_is_found_from_architectures_or_model_type():
    from kiln.models.registry import DIFFUSION, family_of_hf

    def family(values):
        found = family_of_hf(values)
        return found.name, found.kind

    assert family({"architectures": ["LLaDAModelLM"]}) == ("llada", DIFFUSION)
    assert family({"model_type": "llada"}) == ("llada", DIFFUSION)
    assert family({"architectures": ["DreamModel"], "model_type": "Dream"}) == ("dream", DIFFUSION)
    assert family({"model_type": "Dream"}) == ("dream", DIFFUSION)
    assert family({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}) == ("qwen2", "autoregressive")
    assert family({"architectures": ["MistralForCausalLM"]}) == ("llama", "autoregressive")
    with pytest.raises(ModelLoadError):
        family_of_hf({})


@pytest.mark.parametrize(
    "name",
    [
        "model.transformer.blocks.0.attn_out.bias",
        "model.transformer.wpe.weight",
        "model.transformer.blocks.0.q_norm.weight",
    ],
)
def test_unexpected_llada_tensor_is_named(name):
    with pytest.raises(ModelLoadError, match=name.replace(".", r"\.")):
        llada_tensors({name: np.zeros(4, np.float32)})


def test_missing_tokenizer_is_refused(tmp_path):
    (write_tiny_dream(tmp_path) / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        load_checkpoint(tmp_path)
