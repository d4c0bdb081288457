"""Each family of tests/hf_families.py (Mistral's window, Qwen3, Qwen3-MoE with YaRN, Mixtral, Phi-3,
Phi-4-mini's partial rotary, SmolLM3, Granite, ERNIE 4.5, GLM-4, OLMo 2 and 3, EXAONE 4, Gemma 1, 2
and 3) against transformers'
eager forward, from checkpoints it wrote; and through the quantizer and a GGUF."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kiln.models.llama import PagedLlama
from kiln.models.loader import load_hf_directory
from kiln.runtime.errors import ModelLoadError

from tests.hf_families import FAMILIES, transformers_gguf, transformers_model, write_family_checkpoint
from tests.tiny_model import make_tiny_tokenizer


pytest.importorskip("transformers")

# Long enough to leave every sliding window and (Phi-3) LongRoPE's 32-token original context.
PROMPT = [5, 9, 200, 17, 33, 71, 140, 250, 8, 12, 90, 300, 41, 77, 150, 6, 19, 260, 101, 55,
          3 + 30, 44, 180, 222, 13, 66, 97, 310, 128, 39, 210, 84, 15, 59, 171]


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(request, tmp_path_factory):
    return request.param, write_family_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def ours(directory) -> PagedLlama:
    checkpoint = load_hf_directory(directory)
    return PagedLlama(checkpoint.config, block_seq_stride=8).load_tensors(checkpoint.tensors).eval()


@pytest.mark.parametrize("length", [12, len(PROMPT)], ids=["short", "long"])
def test_logits_match_transformers(family_dir, length):
    family, directory = family_dir
    tokens = torch.tensor([PROMPT[:length]])
    with torch.no_grad():
        want = transformers_model(directory)(tokens).logits[0].numpy()
        got = ours(directory).forward_reference(tokens)[0].numpy()
    assert np.abs(got - want).max() < 1e-4, family


def test_greedy_tokens_match_transformers_through_the_paged_cache(family_dir):
    """Prefill in two chunks and decode one token at a time through the paged cache (eager torch),
    against transformers' own greedy generate."""
    family, directory = family_dir
    model, steps = ours(directory), 12
    prompt = PROMPT[:20]
    with torch.no_grad():
        reference = transformers_model(directory)
        reference.generation_config.eos_token_id = None  # every step's argmax, the end token's included
        hf = reference.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False)[0, len(prompt):].tolist()
        cache = model.allocate_cache(16)
        table = torch.tensor([[3, 7, 2, 9, 11, 5]])
        h = model.forward_paged(torch.tensor([prompt[:16]]), torch.tensor([0]), torch.tensor([16]), table[:, :2], cache)
        rest = torch.tensor([prompt[16:] + [0] * 4])  # padded to a page; padding goes to page 0
        h = model.forward_paged(rest, torch.tensor([16]), torch.tensor([20]), table[:, :3], cache)
        generated = [int(model.logits(h)[0, 3].argmax())]
        while len(generated) < steps:
            position = len(prompt) + len(generated) - 1
            h = model.forward_paged(torch.tensor([[generated[-1]]]), torch.tensor([position]),
                                    torch.tensor([position + 1]), table, cache)
            generated.append(int(model.logits(h)[0, 0].argmax()))
    assert generated == hf, family


def test_config_reads_each_familys_departures(tmp_path):
    gemma3 = load_hf_directory(write_family_checkpoint("gemma3", tmp_path / "gemma3")).config
    assert (gemma3.qk_norm, gemma3.sandwich_norms, gemma3.hidden_act) == (True, True, "gelu_tanh")
    assert gemma3.layer_types == ["sliding_attention", "full_attention"] * 2 and gemma3.sliding_window == 6
    assert (gemma3.rope_theta, gemma3.rope_local_theta, gemma3.rope_scaling["factor"]) == (1e6, 1e4, 8.0)
    assert gemma3.embedding_multiplier == 8.0 and gemma3.tie_word_embeddings
    phi3 = load_hf_directory(write_family_checkpoint("phi3", tmp_path / "phi3")).config
    assert phi3.rope_scaling["rope_type"] == "longrope" and set(phi3.layer_types) == {"sliding_attention"}
    mistral = load_hf_directory(write_family_checkpoint("mistral", tmp_path / "mistral")).config
    assert (mistral.architecture, mistral.sliding_window, set(mistral.layer_types)) == ("llama", 12, {"sliding_attention"})


def test_config_reads_partial_rotary_and_yarn(tmp_path):
    phi4 = load_hf_directory(write_family_checkpoint("phi4_mini", tmp_path / "phi4")).config
    assert (phi4.head_dim, phi4.rotary_dim, len(phi4.rope_scaling["long_factor"])) == (16, 12, 6)
    moe = load_hf_directory(write_family_checkpoint("qwen3_moe", tmp_path / "moe")).config
    assert moe.rope_scaling["rope_type"] == "yarn" and moe.rope_scaling["factor"] == 4.0


def test_an_unknown_rope_scaling_is_refused_by_name(tmp_path):
    directory = write_family_checkpoint("qwen3", tmp_path)
    values = json.loads((directory / "config.json").read_text())
    values["rope_parameters"] = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    (directory / "config.json").write_text(json.dumps(values))
    with pytest.raises(ModelLoadError, match="rope scaling 'dynamic' is not supported"):
        load_hf_directory(directory)


def test_qwen3_gguf_round_trip_reads_as_transformers_does(tmp_path):
    """Qwen3 written as a `qwen3` GGUF (its QK-norms as attn_q_norm / attn_k_norm) and read back: the
    same logits from Kiln, and transformers' GGUF reader sees the same tensors."""
    from kiln.models.gguf_loader import load_gguf
    from kiln.models.gguf_writer import write_gguf

    checkpoint = load_hf_directory(write_family_checkpoint("qwen3", tmp_path / "hf"))
    path = write_gguf(checkpoint, tmp_path / "qwen3.gguf")
    loaded = load_gguf(path)
    assert loaded.config.qk_norm and loaded.config.architecture == "qwen3" and loaded.config.head_dim == 32
    tokens = torch.tensor([PROMPT])
    with torch.no_grad():
        want = PagedLlama(checkpoint.config).load_tensors(checkpoint.tensors).eval().forward_reference(tokens)
        got = PagedLlama(loaded.config).load_tensors(loaded.tensors).eval().forward_reference(tokens)
    assert (got - want).abs().max() < 1e-5
    import transformers

    _, tensors = transformers_gguf(path, transformers.Qwen3Config, transformers.Qwen3ForCausalLM)
    assert set(tensors) == set(checkpoint.tensors)
    for name, value in tensors.items():
        np.testing.assert_array_equal(np.asarray(value, dtype=np.float32), checkpoint.tensors[name], err_msg=name)


# What llama.cpp's GGUF cannot say, set to what it takes for granted: Gemma 2's scores scaled by the
# head size (its query_pre_attn_scalar is implied, not stored).
GGUF_IMPLIED = {"gemma2": {"query_pre_attn_scalar": 16.0}}


@pytest.mark.parametrize("family,arch", [("qwen3_moe", "qwen3moe"), ("qwen2_moe", "qwen2moe"), ("mixtral", "llama"),
                                         ("phi3", "phi3"), ("phi4_mini", "phi3"), ("smollm3", "smollm3"), ("granite",
                                         "granite"), ("ernie4_5", "ernie4_5"), ("glm4", "glm4"), ("olmo2", "olmo2"),
                                         ("olmo3", "olmo2"), ("exaone4", "exaone4"), ("gemma", "gemma"), ("gemma2",
                                         "gemma2")])
def test_a_familys_gguf_reads_back_as_its_hf_checkpoint(tmp_path, family, arch):
    """Written as llama.cpp's converter lays the family out (experts stacked as ffn_*_exps under a
    router ffn_gate_inp; Phi-3's attn_qkv and gate_up as ffn_up, its LongRoPE factors as tensors;
    Gemma 2's soft-caps, window and (1 + w) norms; Mixtral as a Llama with experts and permuted q/k)
    and read back: the same config and the same logits as from the HF directory (Qwen3-MoE's YaRN as
    its rope.scaling keys, Phi-4-mini's partial rotary as rope.dimension_count under a head size the
    fused attn_qkv's rows tell; SmolLM3's every fourth layer unrotated, as llama.cpp takes it; Granite's
    multipliers as its *_scale keys; OLMo 3's sliding layers as olmo2's window pattern)."""
    import dataclasses

    from kiln.models.gguf_loader import load_gguf, read_gguf_metadata
    from kiln.models.gguf_writer import write_gguf

    checkpoint = load_hf_directory(write_family_checkpoint(family, tmp_path / "hf"))
    checkpoint.config = dataclasses.replace(checkpoint.config, **GGUF_IMPLIED.get(family, {}))
    path = write_gguf(checkpoint, tmp_path / f"{family}.gguf")
    assert read_gguf_metadata(path)["general.architecture"] == arch
    loaded = load_gguf(path)
    want, got = checkpoint.config, loaded.config
    for field in ("architecture", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                  "dense_layers", "layer_types", "sliding_window", "attn_logit_softcapping", "final_logit_softcapping",
                  "query_pre_attn_scalar", "embedding_multiplier", "hidden_act", "tie_word_embeddings",
                  "head_dim", "rotary_dim", "unrotated_layers", "residual_multiplier", "logits_scaling",
                  "pre_norms", "qk_norm_whole", "rope_local_theta"):
        value = getattr(want, field)
        assert getattr(got, field) == (pytest.approx(value, rel=1e-6) if isinstance(value, float) else value), field
    if family == "qwen3_moe":
        assert got.rope_scaling == want.rope_scaling
    if family.startswith("phi"):
        assert got.rope_scaling["long_factor"] == pytest.approx(want.rope_scaling["long_factor"], rel=1e-6)
        for key in ("short_factor", "original_max_position_embeddings"):
            assert got.rope_scaling[key] == pytest.approx(want.rope_scaling[key], rel=1e-6), key
    assert set(loaded.tensors) == set(checkpoint.tensors)
    tokens = torch.tensor([PROMPT])
    with torch.no_grad():
        expected = PagedLlama(want).load_tensors(checkpoint.tensors).eval().forward_reference(tokens)
        logits = PagedLlama(got).load_tensors(loaded.tensors).eval().forward_reference(tokens)
    assert (logits - expected).abs().max() < 1e-5, family


def test_a_gemma2_gguf_scales_scores_as_llama_cpp_does():
    """A `gemma2` GGUF stores no query_pre_attn_scalar: llama.cpp scales by the head size, but by
    hidden / heads in the 27B (46 layers, 4608 / 32 = 144 where its head size is 128)."""
    from kiln.models.families import gemma2_gguf_config

    metadata = {"attention.sliding_window": 4096, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}

    def key(name, default=None, required=False):
        return metadata.get(name, default)

    big = gemma2_gguf_config(key, {"num_hidden_layers": 46, "hidden_size": 4608, "num_attention_heads": 32,
                                   "head_dim": 128})
    small = gemma2_gguf_config(key, {"num_hidden_layers": 26, "hidden_size": 2304, "num_attention_heads": 8,
                                     "head_dim": 256})
    assert (big["query_pre_attn_scalar"], small["query_pre_attn_scalar"]) == (144.0, 256.0)
    assert small["layer_types"][:3] == ["sliding_attention", "full_attention", "sliding_attention"]
    assert (small["sliding_window"], small["attn_logit_softcapping"], small["final_logit_softcapping"]) == (
        4096, 50.0, 30.0)


@pytest.mark.parametrize("family", ["phi3", "glm4", "ernie4_5"])
def test_a_gguf_s_fused_and_reordered_blocks_are_served_with_their_rows(tmp_path, family):
    """A Q8_0 GGUF's blocks are served as stored: Phi-3's attn_qkv and Phi-3's and GLM-4's ffn_up
    (gate_up) split, each part's blocks its rows of the fused tensor's; GLM-4's and ERNIE's q and k
    rows reordered from adjacent rotary pairs; each standing for the weight read."""
    from kiln.models.gguf_loader import load_gguf
    from kiln.models.gguf_writer import write_gguf

    checkpoint = load_hf_directory(write_family_checkpoint(family, tmp_path / "hf"))
    loaded = load_gguf(write_gguf(checkpoint, tmp_path / f"{family}-q8_0.gguf", dtype="q8_0"))
    assert loaded.stored_quantization == "q8_0"
    for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
        name = f"model.layers.2.{part}.weight"
        np.testing.assert_array_equal(loaded.blocks[name].dequantized(), loaded.tensors[name], err_msg=name)
        original = checkpoint.tensors[name]
        assert np.abs(loaded.tensors[name] - original).max() < 0.01 * np.abs(original).max(), name


def test_a_mixtral_gguf_with_each_expert_apart_is_refused_by_name(tmp_path):
    import gguf

    from kiln.models.gguf_loader import load_gguf
    from kiln.models.gguf_writer import write_gguf

    path = write_gguf(load_hf_directory(write_family_checkpoint("mixtral", tmp_path / "hf")), tmp_path / "new.gguf")
    reader = gguf.GGUFReader(path)
    old = gguf.GGUFWriter(tmp_path / "old.gguf", "llama")
    for key, field in reader.fields.items():
        if not key.startswith(("GGUF.", "general.architecture")):
            old.add_key_value(key, field.contents(), field.types[0], field.types[-1] if len(field.types) > 1 else None)
    for tensor in reader.tensors:
        if "_exps" in tensor.name:  # one tensor per expert, as llama.cpp once wrote them
            for expert, rows in enumerate(np.asarray(tensor.data)):
                old.add_tensor(tensor.name.replace("_exps.weight", f".{expert}.weight"), np.array(rows))
        else:
            old.add_tensor(tensor.name, np.array(tensor.data))
    old.write_header_to_file()
    old.write_kv_data_to_file()
    old.write_tensors_to_file()
    old.close()
    with pytest.raises(ModelLoadError, match="holds one expert alone.*current llama.cpp"):
        load_gguf(tmp_path / "old.gguf")


def experts_stacked(tensors: dict) -> dict:
    """Per-expert `mlp.experts.{j}.{gate,up,down}_proj.weight` as transformers holds them in memory:
    `mlp.experts.gate_up_proj` [E, 2 x ff, hidden] (gate rows first) and `mlp.experts.down_proj`."""
    import re

    out, experts = {}, {}
    for name, value in tensors.items():
        if m := re.match(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+)_proj\.weight$", name):
            experts.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = value
        else:
            out[name] = value
    for prefix, parts in experts.items():
        count = 1 + max(j for j, _ in parts)
        out[f"{prefix}.gate_up_proj"] = np.stack([np.concatenate([parts[j, "gate"], parts[j, "up"]])
                                                  for j in range(count)])
        out[f"{prefix}.down_proj"] = np.stack([parts[j, "down"] for j in range(count)])
    return out


@pytest.mark.parametrize("family", ["qwen3_moe", "phi3", "gemma2"])
def test_transformers_reads_our_gguf_of_a_family_as_its_own_checkpoint(tmp_path, family):
    """An independent reading of the layout: transformers' GGUF reader, given the file Kiln writes
    as llama.cpp's converter would, finds the tensors transformers saved (its own names, its own
    fusing and its own norm convention)."""
    import safetensors.numpy
    import transformers

    from kiln.models.gguf_writer import write_gguf

    directory = write_family_checkpoint(family, tmp_path / "hf")
    path = write_gguf(load_hf_directory(directory), tmp_path / f"{family}.gguf")
    classes = {"qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
               "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
               "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM)}[family]
    _, tensors = transformers_gguf(path, *classes, pad_token_id=0)
    saved = safetensors.numpy.load_file(str(directory / "model.safetensors"))
    if family == "qwen3_moe":  # saved per expert, as the Hub has them; read as transformers holds them
        saved = experts_stacked(saved)
        # The dense layer (mlp_only_layers) has no place in llama.cpp's qwen3moe, nor in what
        # transformers reads from it; Kiln reads a layer without a router as dense.
        dense = {name for name in saved if name.startswith("model.layers.1.mlp.")}
        assert dense and not dense & set(tensors)
        saved = {name: value for name, value in saved.items() if name not in dense}
    assert set(tensors) == set(saved)
    for name, value in tensors.items():
        np.testing.assert_allclose(np.asarray(value, dtype=np.float32), saved[name], rtol=1e-6, atol=1e-6,
                                   err_msg=name)


@pytest.mark.parametrize("mode", ["bf16", "int8", "q8_0"])
def test_quantized_weights_stay_near_the_float_model(family_dir, mode):
    """Every weight matmul (attention, MLP, embedding, a mixture's stacked experts) quantized as
    `kiln build --quantize` does; a mixture's router stays float32, as docs/models.md says. Near-tied
    logits of a random tiny model may swap places, so the top token need only agree at most positions."""
    from torch import nn

    from kiln.models.llama import Experts
    from kiln.models.quantize import quantize_model

    family, directory = family_dir
    model = ours(directory)
    tokens = torch.tensor([PROMPT])
    with torch.no_grad():
        want = model.forward_reference(tokens)
        got = quantize_model(model, mode).forward_reference(tokens)
    assert not [m for m in model.modules() if type(m) in (nn.Linear, nn.Embedding, Experts)]
    errors = (got - want)[0].abs().amax(dim=-1) / want.abs().max()  # per position
    # A mixture's token that rounding routes to another expert differs by more (in any engine), and
    # so may the positions that attend to it: there the typical position is held to the bound.
    error = errors.median() if model.config.num_experts else errors.max()
    # int8's one scale a row rounds most; Phi's LongRoPE factor (1.26 past the original context here)
    # sharpens every score 1.6x, and with them what it moves: one position to 0.07.
    assert error < {"bf16": 2e-2, "int8": 8e-2, "q8_0": 6e-2}[mode], family
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.8, family


def test_a_model_with_gathered_layers_gets_no_context_wide_decode_bucket(tmp_path):
    """The in-place decode kernel takes a table as wide as the context for free, so the export gives
    such a model one decode of max_seq_len; a local or soft-capped layer gathers that table's pages,
    so a model with one keeps decodes as wide as the batch's sequences."""
    from kiln.export.export_model import with_decode_buckets
    from kiln.export.options import ExportOptions

    options = ExportOptions(cpu_kernels=True).validate(256)
    assert with_decode_buckets(load_hf_directory(write_family_checkpoint("qwen3", tmp_path / "q")), options
                               ).decode_buckets == (256,)
    for family in ("gemma2", "gemma3", "phi3"):
        checkpoint = load_hf_directory(write_family_checkpoint(family, tmp_path / family))
        assert with_decode_buckets(checkpoint, options).decode_buckets == (), family


def test_a_llama_gguf_with_partial_rotary_is_refused_by_name(tmp_path):
    """llama.cpp permutes a `llama` file's q and k rows for rotating whole heads; a partial rotary
    among them could not be read back as transformers rotates it."""
    import dataclasses

    from kiln.models.gguf_loader import load_gguf
    from kiln.models.gguf_writer import write_gguf

    checkpoint = load_hf_directory(write_family_checkpoint("phi4_mini", tmp_path / "hf"))
    checkpoint.config = dataclasses.replace(checkpoint.config, architecture="llama", rope_scaling=None,
                                            layer_types=[], sliding_window=None)
    path = write_gguf(checkpoint, tmp_path / "partial.gguf")
    with pytest.raises(ModelLoadError, match="rotating 12 of a head's 16 dimensions"):
        load_gguf(path)


def test_ernie_s_first_layout_reads_as_its_transformers_layout(tmp_path):
    """Baidu's first ERNIE 4.5 checkpoints: tensors under `ernie.`, q, k and v as one `qkv_proj`, and
    `up_gate_proj` (gate rows first), as llama.cpp's converter reads them: the same logits."""
    import shutil

    from safetensors.numpy import load_file, save_file

    directory = write_family_checkpoint("ernie4_5", tmp_path / "transformers")
    first = tmp_path / "first"
    shutil.copytree(directory, first)
    tensors, fused = load_file(str(directory / "model.safetensors")), {}
    for name, value in tensors.items():
        if any(f".{part}." in name for part in ("k_proj", "v_proj", "up_proj")):
            continue
        if ".q_proj." in name:
            value = np.concatenate([tensors[name.replace("q_proj", part)] for part in ("q_proj", "k_proj", "v_proj")])
            name = name.replace("q_proj", "qkv_proj")
        if ".gate_proj." in name:
            value = np.concatenate([value, tensors[name.replace("gate_proj", "up_proj")]])
            name = name.replace("gate_proj", "up_gate_proj")
        fused[name.replace("model.", "ernie.", 1)] = value
    save_file(fused, str(first / "model.safetensors"))
    tokens = torch.tensor([PROMPT])
    with torch.no_grad():
        want, got = (ours(path).forward_reference(tokens) for path in (directory, first))
    assert torch.equal(got, want)


def test_a_multimodal_gemma3_is_served_as_its_language_model(tmp_path):
    """Gemma 3 4B-27B are Gemma3ForConditionalGeneration checkpoints: its `text_config` (which on the
    Hub writes only what departs from transformers' defaults) and its language model's tensors, the
    vision tower's left out."""
    import transformers

    directory = write_family_checkpoint("gemma3_vision", tmp_path / "full")
    assert type(transformers_model(directory)).__name__ == "Gemma3ForConditionalGeneration"
    whole = load_hf_directory(directory)
    assert whole.config.architecture == "gemma3" and not any("vision" in name for name in whole.tensors)
    values = json.loads((directory / "config.json").read_text())
    defaults = transformers.Gemma3TextConfig().to_dict()
    values["text_config"] = {k: v for k, v in values["text_config"].items() if k not in defaults or defaults[k] != v}
    assert "vocab_size" in values["text_config"] and "rms_norm_eps" not in values["text_config"]
    (directory / "config.json").write_text(json.dumps(values))
    assert load_hf_directory(directory).config == whole.config


def test_a_mistral3_is_served_as_its_language_model(tmp_path):
    """Mistral Small 3.1/3.2's checkpoints are Mistral3ForConditionalGeneration: its `text_config` and
    its language model's tensors, against transformers' own multimodal model on text alone."""
    import transformers as tf

    text = tf.MistralConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=None)
    vision = tf.PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                    image_size=28, patch_size=14, head_dim=16)
    torch.manual_seed(0)
    model = tf.Mistral3ForConditionalGeneration(tf.Mistral3Config(text_config=text, vision_config=vision,
                                                                  image_token_index=380)).eval()
    model.save_pretrained(tmp_path)
    make_tiny_tokenizer(384).save(str(tmp_path / "tokenizer.json"))
    checkpoint = load_hf_directory(tmp_path)
    assert checkpoint.config.architecture == "llama" and not any("vision" in name for name in checkpoint.tensors)
    tokens = torch.tensor([PROMPT])
    with torch.no_grad():
        want = model(tokens).logits[0]
        got = PagedLlama(checkpoint.config).load_tensors(checkpoint.tensors).eval().forward_reference(tokens)[0]
    assert (got - want).abs().max() < 1e-4
