"""A tiny random Llama for tests: config, weights and a real byte-level BPE tokenizer.

`make_tiny_checkpoint()` builds it in memory (well under a second);
`write_hf_directory()` saves it the way a Hugging Face model repo looks.
"""

from __future__ import annotations

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from kiln.models.checkpoint import Checkpoint
from kiln.models.config import LlamaConfig
from kiln.models.hf_writer import hf_config_dict, write_hf_directory  # noqa: F401  (re-exported for tests)

SPECIAL_TOKENS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
BOS_ID, EOS_ID, IM_START_ID, IM_END_ID = 0, 1, 2, 3

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Once upon a time, in a small village by the sea, there lived an old fisherman and his wife.
Every morning he went out in his boat, and every evening he came back with fish for the market.
The weather was cold in the winter and warm in the summer, and the children played on the beach.
Machine learning models read text as tokens; a tokenizer turns words into numbers and back again.
Hello, world! How are you today? I am fine, thank you. What is the time? It is ten past three.
Numbers such as 1, 2, 3, 42, 100 and 2024 appear in text, as do dates like 12 March and prices like $9.99.
def add(a, b):
    return a + b
She said: "It's the best thing I've ever seen, and we'll do it again." They'd agreed, hadn't they?
Water boils at one hundred degrees; ice melts at zero. The sun rises in the east and sets in the west.
"""

DEFAULT_CONFIG = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    attention_bias=False,
    bos_token_id=BOS_ID,
    eos_token_ids=[EOS_ID, IM_END_ID],
    architecture="llama",
    name="kiln-tiny-llama",
)


def make_tiny_tokenizer(vocab_size: int = 384, add_bos: bool = True,
                        special_tokens: list[str] = SPECIAL_TOKENS) -> Tokenizer:
    """A byte-level BPE trained on CORPUS to exactly `vocab_size` tokens (deterministic);
    `special_tokens` take the first ids, in order."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True) * 4, trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(f"the corpus only yields {tok.get_vocab_size()} tokens, not {vocab_size}")
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", BOS_ID)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def random_weights(config: LlamaConfig, seed: int) -> dict[str, np.ndarray]:
    """Seeded random weights in Kiln's (HF) tensor names, scaled to keep activations near 1."""
    rng = np.random.default_rng(seed)
    c = config

    def w(*shape, scale=0.02):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def norm(n):
        return (1.0 + rng.standard_normal(n) * 0.1).astype(np.float32)

    q_rows, kv_rows = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    t = {"model.embed_tokens.weight": w(c.vocab_size, c.hidden_size, scale=1.0)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm(c.hidden_size)
        t[p + "self_attn.q_proj.weight"] = w(q_rows, c.hidden_size, scale=c.hidden_size**-0.5)
        t[p + "self_attn.k_proj.weight"] = w(kv_rows, c.hidden_size, scale=c.hidden_size**-0.5)
        t[p + "self_attn.v_proj.weight"] = w(kv_rows, c.hidden_size, scale=c.hidden_size**-0.5)
        t[p + "self_attn.o_proj.weight"] = w(c.hidden_size, q_rows, scale=q_rows**-0.5)
        if c.attention_bias:
            t[p + "self_attn.q_proj.bias"] = w(q_rows, scale=0.1)
            t[p + "self_attn.k_proj.bias"] = w(kv_rows, scale=0.1)
            t[p + "self_attn.v_proj.bias"] = w(kv_rows, scale=0.1)
        t[p + "post_attention_layernorm.weight"] = norm(c.hidden_size)
        t[p + "mlp.gate_proj.weight"] = w(c.intermediate_size, c.hidden_size, scale=c.hidden_size**-0.5)
        t[p + "mlp.up_proj.weight"] = w(c.intermediate_size, c.hidden_size, scale=c.hidden_size**-0.5)
        t[p + "mlp.down_proj.weight"] = w(c.hidden_size, c.intermediate_size, scale=c.intermediate_size**-0.5)
    t["model.norm.weight"] = norm(c.hidden_size)
    if not c.tie_word_embeddings:
        t["lm_head.weight"] = w(c.vocab_size, c.hidden_size, scale=c.hidden_size**-0.5)
    return t


def tiny_tokenizer_config(add_bos: bool, model_max_length: int, **extra) -> dict:
    """tokenizer_config.json for the tiny tokenizer, with the ChatML template."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": None,
        "pad_token": "</s>",
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHATML_TEMPLATE,
        "model_max_length": model_max_length,
        **extra,
    }


# Where each block type's float16 fields sit in its block: random bytes elsewhere make a valid block.
_HALVES = {"Q8_0": (0,), "Q4_0": (0,), "Q5_0": (0,), "Q4_1": (0, 2), "Q5_1": (0, 2), "Q4_K": (0, 2),
           "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(qtype: str, rows: int, columns: int, seed: int = 0, scale: float = 1e-3) -> np.ndarray:
    """A [rows, columns] tensor of GGUF block type `qtype` as raw bytes: random values, scales and
    minimums, its float16 fields drawn around `scale` (gguf-py has no quantizer for the k-quants)."""
    from kiln.models.gguf_blocks import BLOCK, BLOCK_BYTES, SUPER_BLOCK

    rng = np.random.default_rng(seed)
    per = SUPER_BLOCK if qtype.endswith("_K") else BLOCK
    raw = rng.integers(0, 256, (rows, columns // per, BLOCK_BYTES[qtype]), dtype=np.uint8)
    for at in _HALVES[qtype]:
        raw[..., at:at + 2] = rng.normal(0, scale, (*raw.shape[:2], 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def make_tiny_checkpoint(seed: int = 0, add_bos: bool = True, **overrides) -> Checkpoint:
    """A tiny random Llama; `overrides` replace LlamaConfig fields (e.g. tie_word_embeddings=True)."""
    config = LlamaConfig(**{**DEFAULT_CONFIG, **overrides})
    tokenizer = make_tiny_tokenizer(config.vocab_size, add_bos=add_bos)
    return Checkpoint(
        config=config,
        tensors=random_weights(config, seed),
        tokenizer_json=tokenizer.to_str(),
        tokenizer_config=tiny_tokenizer_config(add_bos, config.max_position_embeddings),
        source=f"tiny(seed={seed})",
    )
