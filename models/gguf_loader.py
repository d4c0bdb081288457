"""Load a llama.cpp GGUF file into a `Checkpoint` (HF names, float32 numpy).

GGUF is how many Llama-family models ship (the bundled SmolLM2 among them). We
dequantize every tensor with `gguf.quants`, rename it to Hugging Face's name, undo
llama.cpp's Q/K row permutation, and rebuild config and tokenizer from the metadata:
what comes out equals what transformers loads from the same file.
"""

from __future__ import annotations

import functools
import math
import mmap
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kiln.runtime.errors import ModelLoadError
from kiln.runtime.sampling import model_generation_defaults

from .checkpoint import Checkpoint
from .config import LlamaConfig
from .gguf_blocks import BLOCK_TYPES, BlockWeight, read_blocks
from .gguf_tokenizer import tokenizer_from_gguf
from .lazy_arrays import LazyArrays
from .registry import family_named, family_of_gguf
from .rope import llama3_divisors, unpermute_qk
from .sentence_transformers import EmbeddingSpec


# GGUF tensor name (without .weight/.bias) -> HF module name.
GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "attention_output_norm",
    "post_ffw_norm": "mlp_output_norm",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3's q, k and v in one (split on reading)
    "ffn_gate_inp": "mlp.gate",  # a mixture's router
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",  # Qwen2-MoE's shared expert, and its gate
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# A mixture's experts, each a [E, rows, K] stack: GGUF name -> Kiln's parameter (no .weight).
EXPERT_NAMES = {"ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
                "ffn_down_exps": "mlp.experts.down_proj"}
# Architectures whose q/k rows llama.cpp's converter permutes (its `LlamaModel` and those built on it).
PERMUTED_QK = ("llama", "mixtral", "smollm3", "granite")
# Architectures whose own checkpoints rotate adjacent pairs, over their rotary dimensions (read as
# the permuted ones are; llama.cpp keeps their rows as they are).
ADJACENT_PAIRS = ("ernie4_5", "glm4")
# Turn-ending tokens llama.cpp also stops at, found by their text: a GGUF names no id for them
# (Gemma's <end_of_turn>, Phi-3's <|end|>).
END_OF_TURN_TEXTS = ("<end_of_turn>", "<|end|>")
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^([a-z_]+)\.(weight|bias)$")
_OLD_EXPERT_RE = re.compile(r"^blk\.\d+\.ffn_(gate|up|down)\.\d+\.weight$")


def hf_tensor_name(gguf_name: str) -> str | None:
    """HF name for a GGUF tensor name, or None if it is not one of a Llama's tensors."""
    if m := _LAYER_RE.match(gguf_name):
        if m.group(2) in EXPERT_NAMES and m.group(3) == "weight":
            return f"model.layers.{m.group(1)}.{EXPERT_NAMES[m.group(2)]}"
        module = LAYER_NAMES.get(m.group(2))
        return f"model.layers.{m.group(1)}.{module}.{m.group(3)}" if module else None
    if m := _GLOBAL_RE.match(gguf_name):
        module = GLOBAL_NAMES.get(m.group(1))
        return f"{module}.{m.group(2)}" if module else None
    return None


def llama3_rope_factors(
    rope_theta: float, head_dim: int, factor: float, low_freq_factor: float,
    high_freq_factor: float, original_max_position_embeddings: int,
) -> np.ndarray:
    """The `rope_freqs.weight` tensor convert_hf_to_gguf writes for Llama-3 rope scaling
    (the divisor of each rotary frequency, from float32 frequencies as it computes them)."""
    freqs = 1.0 / (np.float32(rope_theta) ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)))
    scaling = {"factor": factor, "low_freq_factor": low_freq_factor, "high_freq_factor": high_freq_factor,
               "original_max_position_embeddings": original_max_position_embeddings}
    return llama3_divisors(freqs, scaling).astype(np.float32)


def _short(x: float) -> float:
    """A float32 read back as the short decimal it was written from (9.9999997e-06 -> 1e-05)."""
    return float(f"{x:.7g}")


def _rope_scaling_from_freqs(freqs: np.ndarray, rope_theta: float, head_dim: int) -> dict[str, Any] | None:
    """Recover HF's `rope_scaling` (rope_type llama3) from a rope_freqs tensor.

    Only the ratios original_context/low_freq_factor and original_context/high_freq_factor
    are determined by the tensor; we take low_freq_factor = 1 (what every Llama 3.x uses)
    unless Llama 3.1's own values reproduce it, and check the result reproduces the tensor.
    """
    freqs = np.asarray(freqs, dtype=np.float64).reshape(-1)
    factor = float(freqs.max())
    if factor <= 1.0 + 1e-6:
        return None
    inv = 1.0 / (rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    x = inv / (2 * math.pi)  # 1 / wavelength
    candidates = [(1.0, 4.0, 8192)]
    middle = (freqs > 1.0 + 1e-6) & (freqs < factor * (1 - 1e-6))
    if middle.sum() >= 2:
        smooth = (1.0 / freqs[middle] - 1.0 / factor) / (1.0 - 1.0 / factor)
        a, b = np.polyfit(x[middle], smooth, 1)
        x0, x1 = -b / a, (1.0 - b) / a  # smooth = 0 and smooth = 1: low/orig, high/orig
        if x0 > 0 and x1 > x0:
            orig = int(round(1.0 / x0))
            candidates.append((1.0, float(f"{x1 / x0:.5g}"), orig))
    for low, high, orig in candidates:
        scaling = {
            "rope_type": "llama3",
            "factor": _short(factor),
            "low_freq_factor": low,
            "high_freq_factor": high,
            "original_max_position_embeddings": orig,
        }
        expect = llama3_rope_factors(rope_theta, head_dim, scaling["factor"], low, high, orig)
        if np.allclose(expect, freqs, rtol=1e-4, atol=1e-6):
            return scaling
    raise ModelLoadError(
        "the GGUF's rope_freqs tensor does not match Llama-3 rope scaling; Kiln cannot run this rope variant"
    )


def _field_value(field) -> Any:
    from gguf import GGUFValueType

    value = field.contents()
    if field.types and field.types[0] == GGUFValueType.FLOAT32:
        value = _short(value)
    return value


def _dequantize_blocks(raw: np.ndarray, qtype) -> np.ndarray | None:
    """Q1_0 and Q8_K, which gguf-py cannot dequantize (layouts from ggml-common.h), as
    float32 values in file order; None for any other type. Q8_1 stays unsupported: gguf-py
    sizes its block at 40 bytes where ggml's is 36, so its tensors are misread before this
    point (llama.cpp uses Q8_1 and Q8_K only for activations, not stored weights)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

    if qtype not in (Q.Q8_K, Q.Q1_0):
        return None
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, GGML_QUANT_SIZES[qtype][1])
    if qtype == Q.Q1_0:  # f16 scale, then one bit per value: +scale or -scale
        scale = blocks[:, :2].view(np.float16).astype(np.float32)
        bits = np.unpackbits(blocks[:, 2:], axis=1, bitorder="little")
        return np.where(bits == 1, scale, -scale).reshape(-1)
    # Q8_K: f32 scale, 256 int8, then int16 group sums (not needed to dequantize)
    scale, quants = blocks[:, :4].view(np.float32), blocks[:, 4:260].view(np.int8)
    return (quants.astype(np.float32) * scale).reshape(-1)


def _dequantize(tensor) -> np.ndarray:
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    # A copy: the reader's arrays are views of the memory-mapped file.
    return np.array(_values(tensor.data, tensor.tensor_type, tensor.name), dtype=np.float32, copy=True).reshape(shape)


def _values(raw: np.ndarray, qtype, name: str) -> np.ndarray:
    """A tensor's values from its bytes in the file; a ModelLoadError for a type neither gguf-py
    nor Kiln dequantizes (Q8_1, or one newer than both), a refusal rather than a missing path."""
    from gguf import GGMLQuantizationType, quants

    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F64, GGMLQuantizationType.I8,
                 GGMLQuantizationType.I16, GGMLQuantizationType.I32, GGMLQuantizationType.I64):
        return np.asarray(raw)
    if (data := _dequantize_blocks(raw, qtype)) is not None:
        return data
    try:
        return quants.dequantize(raw, qtype)
    except NotImplementedError as e:
        raise ModelLoadError(f"tensor {name}: GGUF type {qtype.name} cannot be dequantized ({e})") from e


def _check_dequantizable(tensor, checked: set) -> None:
    """Refuse, when the file is read, a tensor whose type cannot be dequantized: its values are
    made only when the export asks for them (one block of zeros per type is tried here)."""
    from gguf import GGML_QUANT_SIZES

    if tensor.tensor_type in checked:
        return
    block_bytes = GGML_QUANT_SIZES.get(tensor.tensor_type, (1, 4))[1]
    _values(np.zeros(block_bytes, np.uint8), tensor.tensor_type, tensor.name)
    checked.add(tensor.tensor_type)


def _open(path: Path):
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except Exception as e:  # the reader raises ValueError/IndexError/KeyError/... on bad input
        raise ModelLoadError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """All key/value metadata of a GGUF file as plain Python values."""
    reader = _open(Path(path))
    try:
        return {k: _field_value(f) for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    except Exception as e:
        raise ModelLoadError(f"{path}: corrupt GGUF metadata ({type(e).__name__}: {e})") from e


def _yarn_scaling(key) -> dict[str, Any]:
    """HF's YaRN `rope_scaling` from a GGUF's keys, as llama.cpp's converter wrote them from it (its
    log multiplier is HF's `mscale_all_dim` over an `mscale` of 1)."""
    if key("rope.scaling.yarn_ext_factor") not in (None, -1.0, 1.0):
        raise ModelLoadError("a GGUF's YaRN with an extrapolation factor other than 1 is not supported")
    scaling = {"rope_type": "yarn", "factor": float(key("rope.scaling.factor", required=True)),
               "original_max_position_embeddings": int(key("rope.scaling.original_context_length", required=True))}
    if log_multiplier := key("rope.scaling.yarn_log_multiplier"):
        scaling |= {"mscale": 1.0, "mscale_all_dim": float(log_multiplier)}
    for name, gguf_name in (("attention_factor", "yarn_attn_factor"), ("beta_fast", "yarn_beta_fast"),
                            ("beta_slow", "yarn_beta_slow")):
        if (value := key(f"rope.scaling.{gguf_name}")) is not None:
            scaling[name] = float(value)
    return scaling


def _config_from_metadata(meta: dict[str, Any], tensor_rows: dict[str, int], name: str) -> LlamaConfig:
    """`tensor_rows`: each tensor's name and its output rows (its first dimension as HF orders them)."""
    family = family_of_gguf(meta.get("general.architecture"))
    arch = family.gguf_architecture
    if family.name == "llama" and meta.get("llama.expert_count"):
        family = family_named("mixtral")  # llama.cpp writes Mixtral as a Llama with experts

    def key(k: str, default: Any = None, required: bool = False) -> Any:
        v = meta.get(f"{arch}.{k}")
        if v is None:
            if required:
                raise ModelLoadError(f"GGUF metadata {arch}.{k} is missing")
            return default
        return v

    hidden = int(key("embedding_length", required=True))
    n_head = int(key("attention.head_count", required=True))
    n_kv = key("attention.head_count_kv", n_head)
    if isinstance(n_kv, list) or isinstance(n_head, list):
        raise ModelLoadError("per-layer head counts are not supported")
    # The head's size as llama.cpp takes it: key_length where written, else as the query's rows
    # divide among the heads (Phi-3 stores q, k and v as one), else hidden / heads. Fewer rotary
    # dimensions than that is a partial rotary (Phi-4-mini).
    query_rows = tensor_rows.get("blk.0.attn_q.weight", 0)
    if "blk.0.attn_qkv.weight" in tensor_rows:
        query_rows = tensor_rows["blk.0.attn_qkv.weight"] * n_head // (n_head + 2 * int(n_kv))
    head_dim = int(key("attention.key_length", 0) or query_rows // n_head or hidden // n_head)
    rotary_dim = int(key("rope.dimension_count", 0) or head_dim)
    if rotary_dim != head_dim and family.name in PERMUTED_QK:
        raise ModelLoadError(f"a {arch} GGUF rotating {rotary_dim} of a head's {head_dim} dimensions: llama.cpp "
                             "permutes such a file's q and k for whole heads, which Kiln cannot undo")
    rope_theta = float(key("rope.freq_base", 10000.0))

    tokens = meta.get("tokenizer.ggml.tokens") or []
    vocab_size = int(key("vocab_size", 0) or tensor_rows.get("token_embd.weight", 0) or len(tokens))

    rope_scaling = None
    scaling_type = key("rope.scaling.type")
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(key("rope.scaling.factor", 1.0))}
    elif scaling_type == "yarn":
        rope_scaling = _yarn_scaling(key)
    elif scaling_type not in (None, "none"):
        raise ModelLoadError(f"GGUF rope scaling type {scaling_type!r} is not supported")

    eos_ids = []
    for k in ("eos_token_id", "eot_token_id", "eom_token_id"):
        v = meta.get(f"tokenizer.ggml.{k}")
        if v is not None and int(v) not in eos_ids:
            eos_ids.append(int(v))
    eos_ids += [i for i, text in enumerate(tokens) if text in END_OF_TURN_TEXTS and i not in eos_ids]
    bos = meta.get("tokenizer.ggml.bos_token_id")

    fields = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length", required=True)),
        num_hidden_layers=int(key("block_count", required=True)),
        num_attention_heads=n_head,
        num_key_value_heads=int(n_kv),
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(key("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_rows,
        attention_bias=any(n.endswith("attn_q.bias") for n in tensor_rows),
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=eos_ids,
        architecture=family.name,
        model_kind=family.kind,
        name=str(meta.get("general.name") or name),
        qk_norm=any(n.endswith("attn_q_norm.weight") for n in tensor_rows),
        sandwich_norms=any(n.endswith("post_attention_norm.weight") for n in tensor_rows),
    )
    if experts := key("expert_count"):
        # A layer without a router is dense. llama.cpp renormalizes the chosen experts' weights for
        # Mixtral and Qwen3-MoE whatever the file says; expert_weights_norm, where written, is kept.
        fields |= dict(num_experts=int(experts), num_experts_per_tok=int(key("expert_used_count", required=True)),
                       moe_intermediate_size=int(key("expert_feed_forward_length", 0)),
                       shared_expert_intermediate_size=int(key("expert_shared_feed_forward_length", 0)),
                       norm_topk_prob=bool(key("expert_weights_norm", True)),
                       dense_layers=[layer for layer in range(fields["num_hidden_layers"])
                                     if f"blk.{layer}.ffn_gate_inp.weight" not in tensor_rows])
    return LlamaConfig(**fields | family.config_from_gguf(key, fields))


def stored_quantization(tensor_types: list[str]) -> str:
    """The quantization mode that serves a GGUF's 2-D weights (types by name) as stored: every
    one BF16 ("bf16"); every one Q8_0, or Q4_0/Q4_1 beside Q8_0 (the bundled SmolLM2's Q4_1
    layers and Q8_0 embedding), by that type's mode; any other mix of block types Kiln reads
    (BLOCK_TYPES: a Q4_K_M file's Q4_K and Q6_K) "gguf"; "none" for anything else (float, or a
    type Kiln widens)."""
    kinds = set(tensor_types)
    if kinds == {"BF16"}:
        return "bf16"
    if not kinds or not kinds <= set(BLOCK_TYPES):
        return "none"
    for mode, kind in (("q8_0", "Q8_0"), ("q4_0", "Q4_0"), ("q4_1", "Q4_1")):
        if kinds <= {kind, "Q8_0"}:
            return mode
    return "gguf"


# llama.cpp's sampling metadata (general.sampling.*) by the name of the request field it sets.
SAMPLING_KEYS = {"temperature": "temp", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                  "repetition_penalty": "penalty_repeat"}


def gguf_generation_defaults(meta: dict[str, Any], path: Path) -> dict[str, float | int]:
    """The sampling defaults a GGUF's general.sampling.* keys give, checked."""
    values = {field: meta.get(f"general.sampling.{key}") for field, key in SAMPLING_KEYS.items()}
    try:
        return model_generation_defaults(values, f"{path} (general.sampling)")
    except ValueError as error:
        raise ModelLoadError(str(error)) from None


# llama.cpp's enum llama_pooling_type, as a GGUF's {arch}.pooling_type stores it.
GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}


def gguf_embedding_spec(meta: dict[str, Any]) -> EmbeddingSpec:
    """How an embedding GGUF pools (its {arch}.pooling_type; llama.cpp normalises its
    embeddings); last-token pooling where it says nothing (a plain LM's file)."""
    pooling = meta.get(f"{meta.get('general.architecture')}.pooling_type")
    if pooling in (None, 0):  # none: a plain LM, served as vLLM serves a decoder's embeddings
        return EmbeddingSpec()
    if pooling not in GGUF_POOLING:
        return EmbeddingSpec(unsupported=f"its pooling_type {pooling} is not one Kiln runs (mean, CLS, last)")
    return EmbeddingSpec(pooling=GGUF_POOLING[pooling])


# Phi-3's LongRoPE factors, stored as tensors: name -> its rope_scaling key.
LONGROPE_FACTORS = {"rope_factors_long.weight": "long_factor", "rope_factors_short.weight": "short_factor"}


def _row_parts(config: LlamaConfig, name: str) -> dict[str, tuple[int, int]]:
    """A fused tensor's parts, each Kiln's name -> its rows: Phi-3's attn_qkv (q, k, v) and its
    ffn_up (gate, then up: llama.cpp keeps Phi-3's and GLM-4's gate_up_proj whole under ffn_up)."""
    if config.architecture not in ("phi3", "glm4"):
        return {}
    prefix = name.rsplit(".", 2)[0] + "."
    if name.endswith("self_attn.qkv_proj.weight"):
        q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
        return {prefix + "q_proj.weight": (0, q), prefix + "k_proj.weight": (q, q + kv),
                prefix + "v_proj.weight": (q + kv, q + 2 * kv)}
    if name.endswith("mlp.up_proj.weight"):
        ff = config.intermediate_size
        return {prefix + "gate_proj.weight": (0, ff), prefix + "up_proj.weight": (ff, 2 * ff)}
    return {}


def load_gguf(path: str | Path) -> Checkpoint:
    """Read a GGUF file: config, float32 tensors in HF names (each dequantized when asked for,
    models/lazy_arrays.py), the blocks of those Kiln serves as stored, tokenizer."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist")
    reader = _open(path)
    try:
        meta = {k: _field_value(f) for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    except Exception as e:
        raise ModelLoadError(f"{path}: corrupt GGUF metadata ({type(e).__name__}: {e})") from e
    config = _config_from_metadata(meta, {t.name: int(t.shape[-1]) for t in reader.tensors}, path.stem)

    quantization = stored_quantization([t.tensor_type.name for t in reader.tensors if len(t.shape) == 2])
    keep_blocks = quantization not in ("none", "bf16")
    tensors, blocks = LazyArrays(), LazyArrays()
    pages = MappedPages(reader.data)
    dequantizable: set = set()
    rope_freqs = None
    longrope: dict[str, list[float]] = {}
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            rope_freqs = _dequantize(t)
            continue
        if t.name in LONGROPE_FACTORS:
            longrope[LONGROPE_FACTORS[t.name]] = _dequantize(t).astype(np.float64).tolist()
            continue
        hf = hf_tensor_name(t.name)
        if hf is None and _OLD_EXPERT_RE.match(t.name):
            raise ModelLoadError(f"{path}: tensor {t.name!r} holds one expert alone, the layout of GGUFs made "
                                 "before llama.cpp stacked them; convert the model again with a current llama.cpp")
        if hf is None:
            raise ModelLoadError(f"{path}: unexpected tensor {t.name!r} for a {config.architecture} model")
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        _check_data_size(t, shape, path)
        _check_dequantizable(t, dequantizable)
        reorder = None  # q and k rows with their rotary pairs adjacent, to HF's halves
        if config.architecture in PERMUTED_QK + ADJACENT_PAIRS and (".attn_q." in t.name or ".attn_k." in t.name):
            heads = config.num_attention_heads if ".attn_q." in t.name else config.num_key_value_heads
            reorder = functools.partial(unpermute_qk, n_head=heads, rotary=config.rotary_dim)
        # A mixture's experts [E, rows, K] keep their blocks too (where Kiln reads their type), read
        # as E * rows rows; the mode is the 2-D weights' (a type it does not read is quantized to it).
        stored = keep_blocks and (len(shape) == 2 or (len(shape) == 3 and t.tensor_type.name in BLOCK_TYPES))
        parts = _row_parts(config, hf) or {hf: (0, shape[0])}
        if max(stop for _, stop in parts.values()) != shape[0]:
            raise ModelLoadError(f"{path}: tensor {t.name} has {shape[0]} rows, not "
                                 f"{max(stop for _, stop in parts.values())}")
        for name, (start, stop) in parts.items():
            part = (stop - start, *shape[1:])
            tensors.add(name, part, functools.partial(_weight, t, reorder, start, stop, path, pages))
            if stored:
                rows = (math.prod(shape[:-1]), shape[-1])
                blocks.add(name, part, functools.partial(_blocks, t, rows, reorder, start * rows[0] // shape[0],
                                                         stop * rows[0] // shape[0], path, pages),
                           kind=t.tensor_type.name)

    if longrope:
        if set(longrope) != set(LONGROPE_FACTORS.values()) or config.rope_scaling is not None:
            raise ModelLoadError(f"{path}: LongRoPE needs both rope_factors_long and rope_factors_short, "
                                 "and no other rope scaling")
        arch = meta.get("general.architecture")
        original = meta.get(f"{arch}.rope.scaling.original_context_length")
        if original is None:
            raise ModelLoadError(f"{path}: LongRoPE factors without {arch}.rope.scaling.original_context_length")
        config.rope_scaling = {"rope_type": "longrope", **longrope,
                               "original_max_position_embeddings": int(original),
                               "attention_factor": meta.get(f"{arch}.rope.scaling.attn_factor")}

    if rope_freqs is not None:
        if config.rope_scaling is not None:
            raise ModelLoadError(f"{path}: both rope_freqs and {config.rope_scaling} rope scaling")
        config.rope_scaling = _rope_scaling_from_freqs(rope_freqs, config.rope_theta, config.rotary_dim)

    _check_tensors(config, tensors, path)
    try:
        tokenizer_json, tokenizer_config = tokenizer_from_gguf(meta, config.max_position_embeddings)
    except ModelLoadError:
        raise
    except Exception as e:
        raise ModelLoadError(f"{path}: cannot build the tokenizer from its metadata ({e})") from e
    chat_template = family_named(config.architecture).chat_template
    if chat_template and not tokenizer_config.get("chat_template"):
        tokenizer_config["chat_template"] = chat_template
    return Checkpoint(
        config=config,
        tensors=tensors,
        tokenizer_json=tokenizer_json,
        tokenizer_config=tokenizer_config,
        source=str(path),
        stored_quantization=quantization,
        blocks=blocks,
        generation_defaults=gguf_generation_defaults(meta, path),
        embedding=gguf_embedding_spec(meta),
    )


class MappedPages:
    """Lets go of the pages of a memory-mapped file under an array once what was asked of it is made.

    The reader maps the whole file, and every page a weight was read from stays in this process's
    resident memory until the mapping closes: by the end of an export, the file's size beside the
    model (1.1 GB at 1.5B, 4.4 GB at 8B). Dropped, a page read again comes back from the page cache.
    """

    def __init__(self, whole: np.ndarray):
        self._mapping = getattr(whole, "_mmap", None)  # np.memmap's own mmap, from the file's first byte
        self._base = whole.ctypes.data if self._mapping is not None else 0

    def drop(self, array: np.ndarray) -> None:
        if self._mapping is None or not hasattr(self._mapping, "madvise") or array.nbytes == 0:
            return
        start = array.ctypes.data - self._base
        if not 0 <= start < len(self._mapping):
            return  # not a view of this mapping
        first = start // mmap.PAGESIZE * mmap.PAGESIZE
        end = min(len(self._mapping), start + array.nbytes)
        self._mapping.madvise(mmap.MADV_DONTNEED, first, end - first)


def _weight(tensor, reorder: Callable | None, start: int, stop: int, path: Path, pages: MappedPages) -> np.ndarray:
    """Rows start..stop of a tensor as float32, in HF's order (`reorder`: Q's and K's rows to it)."""
    try:
        w = _dequantize(tensor)
    except ModelLoadError:
        raise
    except Exception as e:
        raise ModelLoadError(f"{path}: tensor {tensor.name} is corrupt or truncated ({e})") from e
    pages.drop(tensor.data)
    if reorder is not None:
        w = reorder(w)
    return w if (start, stop) == (0, w.shape[0]) else np.ascontiguousarray(w[start:stop])


def _blocks(tensor, shape: tuple[int, int], reorder: Callable | None, start: int, stop: int, path: Path,
            pages: MappedPages) -> BlockWeight:
    """Rows start..stop of a tensor's blocks as stored, in HF's row order."""
    try:
        stored = read_blocks(tensor.data, tensor.tensor_type.name, *shape)
    except Exception as e:
        raise ModelLoadError(f"{path}: tensor {tensor.name} is corrupt or truncated ({e})") from e
    pages.drop(tensor.data)
    if reorder is not None:
        stored = stored.rows_permuted(reorder)
    return stored if (start, stop) == (0, shape[0]) else stored.rows(start, stop)


def _check_data_size(tensor, shape: tuple[int, ...], path: Path) -> None:
    """A tensor whose bytes in the file are fewer than its type and shape need: refused at load,
    before anything asks for its values."""
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES.get(tensor.tensor_type, (1, 0))
    elements = int(np.prod(shape)) if shape else 1
    if size and (elements % block or tensor.data.nbytes < elements // block * size):
        raise ModelLoadError(f"{path}: tensor {tensor.name} is corrupt or truncated ({tensor.data.nbytes} bytes for "
                             f"{elements} {tensor.tensor_type.name} values)")


def _check_tensors(config: LlamaConfig, tensors: LazyArrays, path: Path) -> None:
    c = config
    q_rows, kv_rows = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    expected = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size), "model.norm.weight": (c.hidden_size,)}
    if not c.tie_word_embeddings:
        expected["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        expected |= {
            p + "self_attn.q_proj.weight": (q_rows, c.hidden_size),
            p + "self_attn.k_proj.weight": (kv_rows, c.hidden_size),
            p + "self_attn.v_proj.weight": (kv_rows, c.hidden_size),
            p + "self_attn.o_proj.weight": (c.hidden_size, q_rows),
        }
        if c.pre_norms:
            expected |= {p + "input_layernorm.weight": (c.hidden_size,),
                         p + "post_attention_layernorm.weight": (c.hidden_size,)}
        if c.is_moe(i):
            e, ff = c.num_experts, c.moe_intermediate_size
            expected |= {
                p + "mlp.gate.weight": (e, c.hidden_size),
                p + "mlp.experts.gate_proj": (e, ff, c.hidden_size),
                p + "mlp.experts.up_proj": (e, ff, c.hidden_size),
                p + "mlp.experts.down_proj": (e, c.hidden_size, ff),
            }
            if shared := c.shared_expert_intermediate_size:
                expected |= {p + "mlp.shared_expert_gate.weight": (1, c.hidden_size),
                             p + "mlp.shared_expert.gate_proj.weight": (shared, c.hidden_size),
                             p + "mlp.shared_expert.up_proj.weight": (shared, c.hidden_size),
                             p + "mlp.shared_expert.down_proj.weight": (c.hidden_size, shared)}
        else:
            expected |= {
                p + "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
                p + "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
                p + "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
            }
        if c.qk_norm:
            q_norm, k_norm = (q_rows, kv_rows) if c.qk_norm_whole else (c.head_dim, c.head_dim)
            expected |= {p + "self_attn.q_norm.weight": (q_norm,), p + "self_attn.k_norm.weight": (k_norm,)}
        if c.sandwich_norms:
            expected |= {p + "attention_output_norm.weight": (c.hidden_size,),
                         p + "mlp_output_norm.weight": (c.hidden_size,)}
        if c.attention_bias:
            expected |= {
                p + "self_attn.q_proj.bias": (q_rows,),
                p + "self_attn.k_proj.bias": (kv_rows,),
                p + "self_attn.v_proj.bias": (kv_rows,),
            }
    for name, shape in expected.items():
        if name not in tensors:
            raise ModelLoadError(f"{path}: tensor {name} is missing")
        if tensors.shape(name) != shape:
            raise ModelLoadError(f"{path}: tensor {name} has shape {tensors.shape(name)}, expected {shape}")
    extra = set(tensors) - set(expected)
    if extra:
        raise ModelLoadError(f"{path}: unexpected tensors {sorted(extra)[:5]}")
