"""The config JSON that export writes and the runtime reads: the contract between them.

`model.json` keeps exactly shortfin's ModelParams fields, because shortfin refuses
unknown keys: that is what lets shortfin serve a Kiln export and Kiln serve a
sharktank export. What Kiln knows beyond that (vocabulary, stop ids, the shape of
prefill's logits...) lives in `model.kiln.json` beside it; a sharktank export has
none, and the runtime then falls back to what it can read off the VMFB.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

KILN_SIDECAR_SUFFIX = ".kiln.json"
# Fields earlier Kiln exports wrote into their sidecar and nothing reads: still accepted.
_FORMER_KILN_FIELDS = {"model_name", "architecture", "bos_token_id", "dtype", "hidden_size",
                       "num_attention_heads", "kiln_version"}

# Element types of weights and of the KV cache an export may have.
DTYPES = ("float32", "float16", "bfloat16")
# The KV cache may also be stored in a byte a value, with a scale per token and head
# (models/kv_quant.py): int8, or fp8 e4m3 (OCP's e4m3fn, as torch.float8_e4m3fn and vLLM's
# "fp8_e4m3" store it). A page keeps its scales after its K and V blocks, so the page pool and the
# tiers move it whole.
BYTE_KV_CACHE_DTYPES = ("int8", "fp8_e4m3")
KV_CACHE_DTYPES = (*DTYPES, *BYTE_KV_CACHE_DTYPES)
# Names other servers give these types, accepted on the command line (vLLM's "fp8" is e4m3).
KV_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}
# Bytes a byte cache keeps per token and head beside the values: a bfloat16 scale.
KV_SCALE_BYTES = 2
# The element type a cache's buffer crosses the ABI as. IREE 3.13's torch import cannot take an
# integer tensor the function writes in place (it leaves the signed element type unconverted), so a
# byte cache travels as float16 of half as many elements, which the functions view as bytes.
KV_STORAGE_DTYPES = {name: "float16" for name in BYTE_KV_CACHE_DTYPES}


def kv_storage_dtype(kv_cache_dtype: str) -> str:
    return KV_STORAGE_DTYPES.get(kv_cache_dtype, kv_cache_dtype)


def kv_storage_elems(elems: int, kv_cache_dtype: str) -> int:
    """`elems` elements of a cache of kv_cache_dtype, counted in its storage type's."""
    return elems // 2 if kv_cache_dtype in KV_STORAGE_DTYPES else elems


def kv_scale_blocks(value_blocks: int, head_dim: int, kv_cache_dtype: str) -> int:
    """Blocks (head_dim x stride elements) a byte cache's page adds after its `value_blocks` K and V
    blocks for their scales, KV_SCALE_BYTES a token each, rounded up to whole blocks; 0 for a float
    cache."""
    return -(-value_blocks * KV_SCALE_BYTES // head_dim) if kv_cache_dtype in BYTE_KV_CACHE_DTYPES else 0


def kv_page_elems(layers: int, kv_heads: int, head_dim: int, block_seq_stride: int, kv_cache_dtype: str) -> int:
    """Elements of kv_cache_dtype in one page: layers x (K, V) x kv_heads blocks of stride x
    head_dim, then a byte cache's scale blocks."""
    blocks = layers * 2 * kv_heads
    return (blocks + kv_scale_blocks(blocks, head_dim, kv_cache_dtype)) * head_dim * block_seq_stride


@dataclass(frozen=True)
class PageGroups:
    """How a model with sliding-window layers lays out its KV pages so that a block's pages for
    those layers can be let go once the block has left their window (vLLM's hybrid allocator):
    each page holds the blocks of `layers_per_page` layers of one kind, a group, and a sequence's
    block has a page in every group (the compiled functions take a table [rows, groups, blocks]).
    Groups of global layers hold a block for the whole sequence; groups of sliding layers only
    while a query still to come may see it (its last key within `window` of the next position)."""

    layers: tuple[tuple[int, ...], ...]  # each group's layers, in page order
    sliding: tuple[bool, ...]  # whether each group's layers are sliding-window ones
    window: int  # how many keys a sliding layer's query sees, its own included

    @classmethod
    def of(cls, sliding_layers: list[bool], window: int) -> "PageGroups":
        """The groups for layers whose kinds `sliding_layers` gives: as many layers a page as
        the greatest common divisor of the two kinds' counts, so no page holds both kinds."""
        kinds = [[i for i, s in enumerate(sliding_layers) if s == sliding] for sliding in (False, True)]
        per_page = math.gcd(*map(len, kinds))
        groups = [(tuple(layers[i:i + per_page]), sliding) for sliding, layers in zip((False, True), kinds)
                  for i in range(0, len(layers), per_page)]
        return cls(tuple(g for g, _ in groups), tuple(s for _, s in groups), window)

    @property
    def layers_per_page(self) -> int:
        return len(self.layers[0])

    @property
    def count(self) -> int:
        return len(self.layers)

    def place(self, layer: int) -> tuple[int, int]:
        """(group, slot within its pages) of layer `layer`."""
        for group, layers in enumerate(self.layers):
            if layer in layers:
                return group, layers.index(layer)
        raise ValueError(f"layer {layer} is in no page group")

    def to_json(self) -> dict[str, Any]:
        return {"layers": [list(g) for g in self.layers], "sliding": list(self.sliding), "window": self.window}

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> "PageGroups":
        return cls(tuple(tuple(g) for g in value["layers"]), tuple(value["sliding"]), int(value["window"]))


# How an export may store its weight matmuls' weights (models/quantize.py).
# "gguf": a GGUF's block-quantized weights, each in its own type (Q4_K beside Q6_K).
QUANTIZATIONS = ("none", "bf16", "int8", "q8_0", "q4_0", "q4_1", "gguf")
# What an export may be asked for: "auto" keeps the checkpoint's own narrow weights where Kiln
# serves them as stored (a GGUF whose weights are all in block types Kiln reads, or all BF16),
# and stores the rest as the model's dtype.
QUANTIZE_CHOICES = ("auto", *QUANTIZATIONS)


@dataclass
class PagedKVCacheParams:
    block_seq_stride: int
    attention_head_count_kv: int
    device_block_count: int
    kv_cache_dtype: str = "float16"


@dataclass
class ModelParams:
    """shortfin's ModelParams, field for field."""

    max_seq_len: int
    transformer_block_count: int
    attn_head_dim: int
    prefill_batch_sizes: list[int]
    decode_batch_sizes: list[int]
    has_prefill_position: bool = False
    use_extend_attention: bool = False
    module_name: str = "module"
    module_abi_version: int = 1
    logits_normalization: str = "none"
    attn_dtype: str = "float16"
    top_k: int | None = None
    paged_kv_cache: PagedKVCacheParams | None = None

    @property
    def block_seq_stride(self) -> int:
        return self.paged_kv_cache.block_seq_stride

    @property
    def page_elems(self) -> int:
        """Elements of the cache buffer's storage type (kv_storage_dtype) in one page: layers x
        (K, V) x kv_heads blocks (the model owns the order)."""
        kv = self.paged_kv_cache
        elems = kv_page_elems(self.transformer_block_count, kv.attention_head_count_kv, self.attn_head_dim,
                              kv.block_seq_stride, kv.kv_cache_dtype)
        return kv_storage_elems(elems, kv.kv_cache_dtype)

    @property
    def page_bytes(self) -> int:
        """Bytes in one page."""
        storage = kv_storage_dtype(self.paged_kv_cache.kv_cache_dtype)
        return self.page_elems * (4 if storage == "float32" else 2)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, values: dict[str, Any]) -> "ModelParams":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known - set(KilnParams.FIELD_NAMES) - _FORMER_KILN_FIELDS)
        if unknown:
            raise ValueError(f"unknown model config keys: {', '.join(unknown)}")
        values = {k: v for k, v in values.items() if k in known}
        kv = values.get("paged_kv_cache")
        if kv is not None:
            kv_known = {f.name for f in fields(PagedKVCacheParams)}
            values["paged_kv_cache"] = PagedKVCacheParams(**{k: v for k, v in kv.items() if k in kv_known})
        return cls(**values)


@dataclass
class KilnParams:
    """What Kiln's export knows beyond shortfin's fields (and the runtime reads)."""

    vocab_size: int = 0
    eos_token_ids: list[int] = field(default_factory=list)
    prefill_final_logits: bool = False  # prefill returns [N, 1, V] at each row's last token
    # A diffusion LM's export has denoise_bs<N> functions instead of prefill/decode; its
    # canvas starts as mask tokens, and with logits_shift 1 output i predicts token i + 1.
    model_kind: str = "autoregressive"  # or "diffusion"
    denoise_batch_sizes: list[int] = field(default_factory=list)
    denoise_top: bool = False  # denoise_top_bs<N> beside each denoise_bs<N>
    mask_token_id: int | None = None
    logits_shift: int = 0
    # Spread over tensor_parallel x pipeline_parallel devices (runtime/device_layout.py): the
    # functions take one KV cache argument per device, each [pages, its page elements].
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    # How the weight matmuls store their weights: "none", "bf16" or "int8" (for the record: the
    # functions' arguments and results are the same whatever it is).
    quantization: str = "none"
    # Context lengths T with decode_bs<N>_ctx<T> beside each decode_bs<N> (contract.fixed_decode_name):
    # the same decode with every shape fixed, for a cache of exactly device_block_count pages.
    decode_buckets: list[int] = field(default_factory=list)
    # The model's own sampling defaults (sampling.MODEL_DEFAULT_FIELDS) for requests that leave
    # those fields unset: its generation_config.json's, as vLLM takes them.
    generation_defaults: dict = field(default_factory=dict)
    # embed_bs<N> for these sizes (contract.FunctionKind.EMBED): the hidden states an embedding
    # pools, `hidden_size` wide; how the model pools them (models/sentence_transformers.py's
    # EmbeddingSpec: pooling, normalize, matryoshka_dimensions).
    embed_batch_sizes: list[int] = field(default_factory=list)
    hidden_size: int = 0
    embedding: dict = field(default_factory=dict)
    # Sizes with a sample_bs<N>: a step's tokens chosen on the device (runtime/contract.py).
    sample_batch_sizes: list[int] = field(default_factory=list)
    # LoRA adapter slots (models/lora.py), empty without: {"slots", "rank", "layers", "modules":
    # {name: [in, out]}}; the functions then take each row's slot and the stacked weights.
    lora: dict = field(default_factory=dict)
    # A model with sliding-window layers: its pages' layer groups (PageGroups.to_json); the
    # functions then take a table [rows, groups, blocks] and a page holds one group's layers.
    page_groups: dict = field(default_factory=dict)

    FIELD_NAMES = ()  # filled below


KilnParams.FIELD_NAMES = tuple(f.name for f in fields(KilnParams))


def sidecar_path(model_json: Path) -> Path:
    model_json = Path(model_json)
    return model_json.with_name(model_json.stem + KILN_SIDECAR_SUFFIX)


def save_model_config(path: Path, params: ModelParams, kiln: KilnParams) -> None:
    path = Path(path)
    path.write_text(json.dumps(params.to_json(), indent=2) + "\n")
    sidecar_path(path).write_text(json.dumps(asdict(kiln), indent=2) + "\n")


def load_model_config(path: Path) -> tuple[ModelParams, KilnParams | None]:
    """Read model.json (and model.kiln.json when it exists)."""
    path = Path(path)
    params = ModelParams.from_json(json.loads(path.read_text()))
    side = sidecar_path(path)
    kiln = None
    if side.exists():
        values = json.loads(side.read_text())
        kiln = KilnParams(**{k: v for k, v in values.items() if k in KilnParams.FIELD_NAMES})
    return params, kiln
