"""What an export is asked to produce, checked before any heavy work starts."""

from __future__ import annotations

from dataclasses import dataclass, replace

from kiln.models.gguf_blocks import BLOCK_TYPES
from kiln.runtime.config import DTYPES, KV_CACHE_DTYPES, QUANTIZE_CHOICES
from kiln.runtime.device_layout import DeviceLayout
from kiln.runtime.errors import ExportError

LOGITS_NORMALIZATIONS = ("none", "softmax", "log_softmax")
# How attention over the gathered pages is written (ExportOptions.attention).
ATTENTION_FORMS = ("matmuls", "fused")
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ExportOptions:
    prefill_batch_sizes: tuple[int, ...] = (1, 4)
    decode_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    # A diffusion LM exports denoise_bs<N> (and no prefill or decode) for these sizes.
    denoise_batch_sizes: tuple[int, ...] = (1, 4)
    # Also export denoise_top_bs<N>: the pass reduced to [N, T, 4] per-position summaries,
    # which the runtime calls when every row of a batch is greedy (no [N, T, V] copy out).
    # Off by default: IREE 3.13's llvm-cpu code for it measured 20-40x slower than denoise
    # with the copy of its logits (benchmarks/README.md, "Diffusion LMs"); for GPUs, unmeasured.
    denoise_top_functions: bool = False
    block_seq_stride: int = 16
    device_block_count: int = 256
    max_seq_len: int = 0  # 0: the model's context length, capped at 8192
    dtype: str = "float32"
    # The KV cache's element type ("": the model's dtype). float16 under a float32 model
    # halves the cache's bytes, so twice the tokens fit (llama.cpp's default). Not faster
    # on IREE 3.13's CPU code: the page gather converts per element (benchmarks/NOTES.md).
    # "int8" and "fp8_e4m3" store a quarter of float32's bytes and a scale per token and head
    # (models/kv_quant.py).
    kv_cache_dtype: str = ""
    # How the weight matmuls store their weights (models/quantize.py): "none" (as dtype),
    # "bf16", "int8" with a scale per output row, "q8_0"/"q4_0"/"q4_1" blocks (a GGUF's own
    # blocks where it stores them), or "gguf" (each of a GGUF's weights in its own block type);
    # activations and KV stay float32. "auto" (QUANTIZE_CHOICES) is resolved by `validate`.
    quantize: str = "auto"
    prefill_final_logits: bool = False
    # Also export prefill_last_bs<N>: the same prefill returning only each row's last
    # logits, which the runtime calls unless a request needs every position's (prompt
    # logprobs). prefill_bs<N> keeps shortfin's full-logits ABI.
    prefill_last_functions: bool = True
    top_k: int | None = None
    logits_normalization: str = "none"
    # Prefill takes start positions: what prefix caching and chunked prefill need.
    has_prefill_position: bool = True
    # Spread the model over tensor_parallel x pipeline_parallel devices (runtime/device_layout.py).
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    # One-token weight matmuls (float32, bf16, the block types of 32) through Kiln's hand-written
    # CPU kernels (export/cpu_kernels.py): the export then compiles for this machine's CPU only.
    cpu_kernels: bool = False
    # With cpu_kernels, a decode step's attention reads the KV pages where they lie
    # (export/cpu_attention.py) rather than gathering them; False keeps the gather, to measure
    # one against the other.
    attention_in_place: bool = True
    # Context lengths T (multiples of the stride, at most max_seq_len) that get a decode with
    # every shape fixed, decode_bs<N>_ctx<T> beside each decode_bs<N>: its block table T / stride
    # wide, its cache exactly device_block_count pages. IREE then records each one's command
    # buffer once, at load, rather than on every call; the runtime calls the smallest that fits
    # wherever its cache has that page count. None: one bucket of max_seq_len where decode
    # attention reads the pages in place (its cost does not grow with the table's width), none
    # otherwise (a gather's does: pick buckets near the contexts served).
    decode_buckets: tuple[int, ...] | None = None
    # Also export embed_bs<N> beside each prefill_bs<N>: the final hidden states, which
    # /v1/embeddings and /v1/score pool (runtime/pooling.py). Off by default, as vLLM serves
    # embeddings only from a model started for them: each adds a prefill's compile.
    embedding_functions: bool = False
    # Attention over the gathered pages: "matmuls" (the scores and weighted sum as matmuls around
    # a blocked softmax, what IREE's llvm-cpu code runs fastest) or "fused" (one SDPA, which IREE
    # lowers to its attention op: a flash-attention kernel on CUDA and ROCm in fewer dispatches,
    # ~10x slower on the CPU at 512 tokens). "" picks by target: fused when every target is a GPU.
    # Decode through the CPU kernel (attention_in_place) reads the pages in place either way.
    attention: str = ""
    # Also export sample_bs<N> for each prefill and decode size: a step's tokens chosen where its
    # logits lie (export/device_sampling.py), so a GPU step sends back ids, not the vocabulary's
    # logits. None: on when every target is a GPU. A diffusion LM has no decode and exports none.
    sampling_functions: bool | None = None
    # LoRA adapters served over the model (models/lora.py): every function also takes each row's
    # adapter slot and the stacked weights of `lora_slots` slots of rank up to `lora_rank` for
    # `lora_modules`; 0 slots: no LoRA, the functions as without it.
    lora_slots: int = 0
    lora_rank: int = 16
    lora_modules: tuple[str, ...] = LORA_MODULES

    @property
    def layout(self) -> DeviceLayout:
        return DeviceLayout(self.tensor_parallel, self.pipeline_parallel)

    @property
    def sample_batch_sizes(self) -> tuple[int, ...]:
        """The sizes that get a sample_bs<N> (with sampling_functions): every decode's and every
        prefill's that returns only last logits (prefill_last, or prefill itself)."""
        if not self.sampling_functions:
            return ()
        last = self.prefill_last_functions or self.prefill_final_logits
        return tuple(sorted(set(self.decode_batch_sizes) | (set(self.prefill_batch_sizes) if last else set())))

    @property
    def cache_dtype(self) -> str:
        return self.kv_cache_dtype or self.dtype

    def validate(self, context_length: int, stored_quantization: str = "none") -> "ExportOptions":
        """These options resolved for a model of `context_length` whose file stores its weights
        as `stored_quantization` (sizes sorted, max_seq_len and quantize filled in), or an
        ExportError that names the option at fault."""
        for name in ("prefill_batch_sizes", "decode_batch_sizes", "denoise_batch_sizes"):
            sizes = getattr(self, name)
            if not sizes or any(not isinstance(s, int) or s < 1 for s in sizes):
                raise ExportError(f"{name} must be positive integers, got {list(sizes)}")
        if self.block_seq_stride < 1:
            raise ExportError(f"block_seq_stride must be positive, got {self.block_seq_stride}")
        if self.device_block_count < 2:
            raise ExportError(
                f"device_block_count must be at least 2 (page 0 is reserved), got {self.device_block_count}"
            )
        if self.dtype not in DTYPES:
            raise ExportError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ExportError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                              f"got {self.kv_cache_dtype!r}")
        if self.quantize not in QUANTIZE_CHOICES:
            raise ExportError(f"quantize must be one of {', '.join(QUANTIZE_CHOICES)}, got {self.quantize!r}")
        quantize = self.quantize
        if quantize == "auto":
            quantize = stored_quantization if self.dtype == "float32" else "none"
        if quantize == "gguf" and stored_quantization in ("none", "bf16"):
            raise ExportError("--quantize gguf serves a GGUF's own blocks: it needs a GGUF whose weight matmuls are "
                              f"all in block types Kiln reads ({', '.join(BLOCK_TYPES)})")
        if quantize != "none" and self.dtype != "float32":
            raise ExportError(f"--quantize {quantize} keeps activations in float32: it needs --dtype float32, "
                              f"got {self.dtype}")
        if self.attention not in ("", *ATTENTION_FORMS):
            raise ExportError(f"attention must be one of {', '.join(ATTENTION_FORMS)}, got {self.attention!r}")
        if self.logits_normalization not in LOGITS_NORMALIZATIONS:
            raise ExportError(
                f"logits_normalization must be one of {', '.join(LOGITS_NORMALIZATIONS)}, "
                f"got {self.logits_normalization!r}"
            )
        if self.top_k is not None and self.top_k < 1:
            raise ExportError(f"top_k must be a positive integer, got {self.top_k}")
        if self.sampling_functions and (self.top_k is not None or self.logits_normalization != "none"):
            raise ExportError("--sampling-functions samples from raw logits: export without --top-k and "
                              "--logits-normalization")
        if self.lora_slots < 0 or self.lora_rank < 1:
            raise ExportError(f"--max-loras must be >= 0 and --max-lora-rank >= 1, got {self.lora_slots} and "
                              f"{self.lora_rank}")
        unknown = sorted(set(self.lora_modules) - set(LORA_MODULES))
        if self.lora_slots and (unknown or not self.lora_modules):
            raise ExportError(f"--lora-modules must be some of {', '.join(LORA_MODULES)}, got "
                              f"{', '.join(self.lora_modules) or 'none'}")
        if self.lora_slots and self.layout.device_count > 1:
            raise ExportError("LoRA adapters apply to a one-device export, not tensor or pipeline parallel ones")
        if self.sampling_functions and self.layout.device_count > 1:
            raise ExportError("--sampling-functions applies to a one-device export, not tensor or pipeline parallel ones")
        if self.cpu_kernels and self.layout.device_count > 1:
            raise ExportError("cpu_kernels apply to a one-device export, not tensor or pipeline parallel ones")
        max_seq_len = self.max_seq_len
        if not max_seq_len:
            cap = min(context_length or 8192, 8192)
            max_seq_len = cap - cap % self.block_seq_stride
        if max_seq_len < 1:
            raise ExportError(f"max_seq_len must be positive, got {max_seq_len}")
        if max_seq_len % self.block_seq_stride:
            raise ExportError(f"block_seq_stride {self.block_seq_stride} does not divide max_seq_len {max_seq_len}")
        buckets = self.decode_buckets
        if buckets is not None:
            stride = self.block_seq_stride
            for context in buckets:
                if not isinstance(context, int) or not 0 < context <= max_seq_len or context % stride:
                    raise ExportError(f"decode buckets must be multiples of block_seq_stride {stride} "
                                      f"up to max_seq_len {max_seq_len}, got {context}")
            if buckets and self.layout.device_count > 1:
                raise ExportError("decode buckets apply to a one-device export, not tensor or pipeline parallel ones")
            buckets = tuple(sorted(set(buckets)))
        return replace(self, prefill_batch_sizes=tuple(sorted(set(self.prefill_batch_sizes))),
                       decode_batch_sizes=tuple(sorted(set(self.decode_batch_sizes))),
                       denoise_batch_sizes=tuple(sorted(set(self.denoise_batch_sizes))), max_seq_len=max_seq_len,
                       quantize=quantize, decode_buckets=buckets)


def parse_decode_buckets(text: str) -> tuple[int, ...]:
    """'512,4096' -> (512, 4096); 'none' -> () (no fixed-shape decode); else an ExportError."""
    if text.strip().lower() == "none":
        return ()
    try:
        return tuple(parse_batch_sizes(text))
    except ExportError:
        raise ExportError("decode buckets must be positive token counts separated by commas, or none; "
                          f"got {text!r}") from None


def parse_batch_sizes(text: str) -> list[int]:
    """'1,4,8' -> [1, 4, 8]; anything else is an ExportError naming the bad item."""
    sizes = []
    for item in text.split(","):
        item = item.strip()
        if not item.isdigit() or int(item) < 1:
            raise ExportError(f"batch sizes must be positive integers separated by commas, got {text!r}")
        sizes.append(int(item))
    return sizes
