"""GGUF reading and writing: tiny-model round trips, bad files, and the real SmolLM2."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from kiln.runtime.errors import ModelLoadError
from kiln.models.gguf_loader import load_gguf, read_gguf_metadata
from kiln.models.rope import permute_qk, unpermute_qk
from kiln.models.gguf_writer import write_gguf
from tests.tiny_model import CORPUS, make_tiny_checkpoint, write_hf_directory

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "Numbers 12345 and 3.14, ünïcödé, 日本語, emoji 🤖🎉",
    "  leading spaces\n\n\ttabs\r\n",
]

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _same_tokenization(json_a: str, json_b: str, texts=TEXTS):
    a, b = Tokenizer.from_str(json_a), Tokenizer.from_str(json_b)
    for text in texts:
        ids = a.encode(text).ids
        assert b.encode(text).ids == ids, text
        assert b.decode(ids, skip_special_tokens=False) == a.decode(ids, skip_special_tokens=False)


# ---------------------------------------------------------------------------
# Round trips on the tiny model
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"tie_word_embeddings": True},
        {"architecture": "qwen2", "attention_bias": True, "rms_norm_eps": 1e-6},
        {"rope_scaling": LLAMA3_SCALING, "rope_theta": 500000.0, "hidden_size": 256, "num_attention_heads": 2,
         "num_key_value_heads": 1},
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    ],
    ids=["untied", "tied", "qwen2-bias", "llama3-rope", "linear-rope"],
)
def test_f32_round_trip_is_exact(tmp_path, overrides):
    ck = make_tiny_checkpoint(**overrides)
    path = write_gguf(ck, tmp_path / "tiny.gguf", dtype="f32")
    back = load_gguf(path)

    assert back.config == ck.config
    assert set(back.tensors) == set(ck.tensors)
    for name, w in ck.tensors.items():
        assert back.tensors[name].dtype == np.float32
        np.testing.assert_array_equal(back.tensors[name], w, err_msg=name)
    assert back.tokenizer_config == ck.tokenizer_config
    _same_tokenization(ck.tokenizer_json, back.tokenizer_json)


def test_tied_model_has_no_output_tensor(tmp_path):
    ck = make_tiny_checkpoint(tie_word_embeddings=True)
    write_gguf(ck, tmp_path / "tied.gguf")
    from gguf import GGUFReader

    names = {t.name for t in GGUFReader(tmp_path / "tied.gguf").tensors}
    assert "output.weight" not in names and "token_embd.weight" in names
    assert load_gguf(tmp_path / "tied.gguf").config.tie_word_embeddings


@pytest.mark.parametrize("dtype, rtol", [("f16", 1e-3), ("q8_0", 1e-2)])
def test_reduced_precision_round_trip(tmp_path, dtype, rtol):
    ck = make_tiny_checkpoint()
    back = load_gguf(write_gguf(ck, tmp_path / f"tiny-{dtype}.gguf", dtype=dtype))
    assert back.config == ck.config
    for name, w in ck.tensors.items():
        got = back.tensors[name]
        if w.ndim == 1:  # norms stay f32, as in llama.cpp
            np.testing.assert_array_equal(got, w, err_msg=name)
        else:
            err = np.abs(got - w).max() / np.abs(w).max()
            assert 0 < err < rtol, (name, err)
    _same_tokenization(ck.tokenizer_json, back.tokenizer_json)


def test_gguf_layout_is_llama_cpp(tmp_path):
    """Names, Q/K permutation and metadata as convert_hf_to_gguf writes them."""
    ck = make_tiny_checkpoint()
    write_gguf(ck, tmp_path / "tiny.gguf")
    from gguf import GGUFReader

    reader = GGUFReader(tmp_path / "tiny.gguf")
    tensors = {t.name: np.array(t.data) for t in reader.tensors}
    c = ck.config
    assert len(tensors) == 3 + 9 * c.num_hidden_layers
    np.testing.assert_array_equal(
        tensors["blk.1.attn_q.weight"],
        permute_qk(ck.tensors["model.layers.1.self_attn.q_proj.weight"], c.num_attention_heads),
    )
    np.testing.assert_array_equal(
        tensors["blk.0.attn_k.weight"],
        permute_qk(ck.tensors["model.layers.0.self_attn.k_proj.weight"], c.num_key_value_heads),
    )
    np.testing.assert_array_equal(tensors["blk.0.ffn_down.weight"], ck.tensors["model.layers.0.mlp.down_proj.weight"])
    np.testing.assert_array_equal(tensors["output.weight"], ck.tensors["lm_head.weight"])

    meta = read_gguf_metadata(tmp_path / "tiny.gguf")
    assert meta["general.architecture"] == "llama"
    assert meta["llama.attention.head_count_kv"] == c.num_key_value_heads
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "gpt2"
    assert len(meta["tokenizer.ggml.tokens"]) == c.vocab_size
    assert meta["tokenizer.ggml.token_type"][:4] == [3, 3, 3, 3]  # the four special tokens: CONTROL
    assert meta["tokenizer.ggml.bos_token_id"] == 0 and meta["tokenizer.ggml.eos_token_id"] == 1
    assert meta["tokenizer.ggml.eot_token_id"] == 3
    assert meta["tokenizer.ggml.add_bos_token"] is True
    assert "<|im_start|>" in meta["tokenizer.chat_template"]


def test_permutation_inverts():
    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    np.testing.assert_array_equal(unpermute_qk(permute_qk(w, 8), 8), w)
    assert not np.array_equal(permute_qk(w, 8), w)


def test_transformers_reads_our_gguf_the_same(tmp_path):
    """An independent reader (transformers' GGUF path) sees the tensors we wrote."""
    pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    ck = make_tiny_checkpoint()
    path = write_gguf(ck, tmp_path / "tiny.gguf")
    parsed = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    hf_config = HFLlamaConfig(**{k: v for k, v in parsed.items() if k != "model_type"})
    with torch.device("meta"):
        model = LlamaForCausalLM(hf_config)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    assert set(tensors) == set(ck.tensors)
    for name, w in tensors.items():
        np.testing.assert_array_equal(np.asarray(w, dtype=np.float32), ck.tensors[name], err_msg=name)


@pytest.mark.parametrize("pre", ["smollm", "llama-bpe", "qwen2"])
def test_pre_tokenizer_names_round_trip(tmp_path, pre):
    """Each byte-level pre-tokenizer llama.cpp names comes back as the same tokenizer."""
    from tokenizers import Regex, normalizers

    from kiln.models.gguf_tokenizer import LLAMA3_SPLIT, QWEN2_SPLIT

    ck = make_tiny_checkpoint()
    tok = Tokenizer.from_str(ck.tokenizer_json)
    if pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    else:
        split = LLAMA3_SPLIT if pre == "llama-bpe" else QWEN2_SPLIT
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        if pre == "qwen2":
            tok.normalizer = normalizers.NFC()
        else:  # Llama 3 looks whole words up before merging
            tj = json.loads(tok.to_str())
            tj["model"]["ignore_merges"] = True
            tok = Tokenizer.from_str(json.dumps(tj))
    ck.tokenizer_json = tok.to_str()
    path = write_gguf(ck, tmp_path / "tiny.gguf")
    assert read_gguf_metadata(path)["tokenizer.ggml.pre"] == pre
    back = load_gguf(path)
    _same_tokenization(ck.tokenizer_json, back.tokenizer_json, TEXTS + ["1234567 items", "don't   stop\n\n  now"])


def _sentencepiece_checkpoint():
    """The tiny model with a Llama-2 style tokenizer: byte fallback, `▁` spaces."""
    trainer = trainers.BpeTrainer(vocab_size=200, show_progress=False)
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=False)
    tok.train_from_iterator(CORPUS.splitlines() * 4, trainer=trainer)
    trained = json.loads(tok.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{i:02X}>": 3 + i for i in range(256)}
    for piece, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    sp = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    sp.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=False)
    sp.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    sp.add_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    sp.post_processor = processors.TemplateProcessing(
        single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", 1)]
    )
    ck = make_tiny_checkpoint(vocab_size=len(vocab), bos_token_id=1, eos_token_ids=[2])
    ck.tokenizer_json = sp.to_str()
    ck.tokenizer_config.update(bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token=None)
    return ck


def test_sentencepiece_tokenizer_round_trip(tmp_path):
    ck = _sentencepiece_checkpoint()
    back = load_gguf(write_gguf(ck, tmp_path / "spm.gguf"))
    meta = read_gguf_metadata(tmp_path / "spm.gguf")
    assert meta["tokenizer.ggml.model"] == "llama"
    assert meta["tokenizer.ggml.token_type"][3] == 6  # <0x00>: BYTE
    assert back.config == ck.config
    texts = ["Hello, world!", "The fisherman's boat", "ünïcödé 🤖 日本", "<s>after bos</s> more", "a\nb"]
    _same_tokenization(ck.tokenizer_json, back.tokenizer_json, texts)


def test_hf_directory_helper(tmp_path):
    from safetensors.numpy import load_file

    ck = make_tiny_checkpoint()
    one = write_hf_directory(ck, tmp_path / "one")
    assert set(load_file(one / "model.safetensors")) == set(ck.tensors)
    two = write_hf_directory(ck, tmp_path / "two", shards=2)
    index = json.loads((two / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) == 2
    loaded = {}
    for f in files:
        loaded |= load_file(two / f)
    assert set(loaded) == set(ck.tensors) == set(index["weight_map"])
    np.testing.assert_array_equal(loaded["lm_head.weight"], ck.tensors["lm_head.weight"])
    config = json.loads((two / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["torch_dtype"] == "float32"
    assert config["eos_token_id"] == ck.config.eos_token_ids


# ---------------------------------------------------------------------------
# Files we must refuse, with a clear error
# ---------------------------------------------------------------------------


def test_random_bytes_are_rejected(tmp_path):
    path = tmp_path / "random.gguf"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        load_gguf(path)


@pytest.mark.parametrize("keep", [0, 3, 24, 200, "half"])
def test_truncated_file_is_rejected(tmp_path, keep):
    good = write_gguf(make_tiny_checkpoint(), tmp_path / "good.gguf").read_bytes()
    n = len(good) // 2 if keep == "half" else keep
    path = tmp_path / "truncated.gguf"
    path.write_bytes(good[:n])
    with pytest.raises(ModelLoadError):
        load_gguf(path)


def test_missing_file_is_rejected(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_gguf(tmp_path / "nope.gguf")


def test_other_architecture_is_rejected(tmp_path):
    import gguf

    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(path, "gpt2")
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="architecture 'gpt2' is not supported"):
        load_gguf(path)


# ---------------------------------------------------------------------------
# The real model: SmolLM2-135M-Instruct (Q4_1)
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    from kiln.models.default_model import default_model_path

    return load_gguf(default_model_path())


@pytest.mark.smollm2
def test_smollm2_config(smollm2):
    c = smollm2.config
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (30, 576, 1536)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (9, 3, 64)
    assert c.vocab_size == 49152 and c.tie_word_embeddings and not c.attention_bias
    assert c.rms_norm_eps == 1e-5 and c.rope_theta == 100000.0 and c.rope_scaling is None
    assert c.max_position_embeddings == 8192
    assert c.bos_token_id == 1 and c.eos_token_ids == [2]
    assert "lm_head.weight" not in smollm2.tensors
    assert smollm2.tensors["model.embed_tokens.weight"].shape == (49152, 576)
    assert smollm2.tensors["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert all(t.dtype == np.float32 for t in smollm2.tensors.values())


@pytest.mark.smollm2
def test_smollm2_tokenizer(smollm2):
    tok = Tokenizer.from_str(smollm2.tokenizer_json)
    enc = tok.encode("1, 2, 3, 4, 5,")
    assert enc.ids == [33, 28, 216, 34, 28, 216, 35, 28, 216, 36, 28, 216, 37, 28]
    assert tok.encode("12345").tokens == ["1", "2", "3", "4", "5"]  # digits one by one
    assert tok.token_to_id("<|im_start|>") == 1 and tok.token_to_id("<|im_end|>") == 2
    assert tok.encode("<|im_start|>user\nHi<|im_end|>").ids[0] == 1
    assert tok.encode("<|im_start|>user\nHi<|im_end|>").ids[-1] == 2
    for text in TEXTS + ["", "Ελληνικά, русский, العربية, हिन्दी", "👩‍👩‍👧 family", "def f(x):\n    return x**2"]:
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text

    tc = smollm2.tokenizer_config
    assert (tc["bos_token"], tc["eos_token"], tc["pad_token"]) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert tc["add_bos_token"] is False and tc["model_max_length"] == 8192
    assert tok.encode("Hi").ids == tok.encode("Hi", add_special_tokens=False).ids  # no BOS added

    import jinja2

    prompt = jinja2.Environment().from_string(tc["chat_template"]).render(
        messages=[{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert tok.encode(prompt).ids[0] == 1


@pytest.mark.smollm2
def test_smollm2_tokenizer_metadata_round_trips():
    """Our tokenizer.json, written back to GGUF metadata, is exactly the file's."""
    from kiln.models.default_model import default_model_path
    from kiln.models.gguf_tokenizer import tokenizer_from_gguf, tokenizer_to_gguf

    meta = read_gguf_metadata(default_model_path())
    tokenizer_json, tokenizer_config = tokenizer_from_gguf(meta, 8192)
    written = tokenizer_to_gguf(tokenizer_json, tokenizer_config, 49152)
    for key, value in written.items():
        assert meta[key] == value, key


def _raw_tensor(qtype, blocks: bytes, values: int):
    from types import SimpleNamespace

    return SimpleNamespace(name="blk.0.attn_q.weight", tensor_type=qtype, shape=np.array([values]),
                           data=np.frombuffer(blocks, np.uint8))


def test_block_types_gguf_py_cannot_dequantize_are_dequantized_by_kiln():
    """Q8_K and Q1_0 (ggml-common.h layouts), one block each, known values."""
    from gguf import GGMLQuantizationType as Q

    from kiln.models.gguf_loader import _dequantize

    ints = np.resize(np.arange(-128, 128, dtype=np.int16), 256).astype(np.int8)
    q8_k = np.float32(0.25).tobytes() + ints.tobytes() + np.zeros(16, np.int16).tobytes()
    np.testing.assert_array_equal(_dequantize(_raw_tensor(Q.Q8_K, q8_k, 256)), ints * np.float32(0.25))

    signs = np.random.default_rng(0).integers(0, 2, 128).astype(np.uint8)
    q1_0 = np.float16(1.5).tobytes() + np.packbits(signs, bitorder="little").tobytes()
    np.testing.assert_array_equal(_dequantize(_raw_tensor(Q.Q1_0, q1_0, 128)), np.where(signs == 1, 1.5, -1.5))


def test_a_type_no_dequantizer_knows_is_a_clear_error():
    """Q8_1 (an activation type gguf-py cannot dequantize, and Kiln does not either): a
    ModelLoadError naming the tensor and type, not a NotImplementedError from the library."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from kiln.models.gguf_loader import _dequantize

    block, type_bytes = GGML_QUANT_SIZES[GGMLQuantizationType.Q8_1]
    tensor = _raw_tensor(GGMLQuantizationType.Q8_1, bytes(type_bytes), block)
    with pytest.raises(ModelLoadError, match="blk.0.attn_q.weight: GGUF type Q8_1 cannot be dequantized"):
        _dequantize(tensor)


def test_a_models_sampling_defaults_round_trip_through_gguf_and_hf_directories(tmp_path):
    from kiln.models.loader import load_checkpoint

    checkpoint = make_tiny_checkpoint(seed=0)
    checkpoint.generation_defaults = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05}
    meta = read_gguf_metadata(write_gguf(checkpoint, tmp_path / "m.gguf"))
    assert meta["general.sampling.temp"] == 0.6 and meta["general.sampling.top_k"] == 20  # llama.cpp's keys
    assert load_gguf(tmp_path / "m.gguf").generation_defaults == checkpoint.generation_defaults
    write_hf_directory(checkpoint, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text())["temperature"] == 0.6
    assert load_checkpoint(tmp_path / "hf").generation_defaults == checkpoint.generation_defaults


def test_a_sampling_default_no_request_could_give_is_refused_at_load_naming_the_file(tmp_path):
    from kiln.models.loader import load_checkpoint

    directory = write_hf_directory(make_tiny_checkpoint(seed=0), tmp_path / "hf")
    generation = json.loads((directory / "generation_config.json").read_text())
    (directory / "generation_config.json").write_text(json.dumps({**generation, "top_p": 0.0}))
    with pytest.raises(ModelLoadError, match=r"generation_config\.json: top_p must be in \(0, 1\]"):
        load_checkpoint(directory)
