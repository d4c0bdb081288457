"""The contract between an export and the runtime: function names, argument orders, file names.

The exporter writes functions and files by these names, and the runtime looks them up
and calls them by the same ones; nothing else in Kiln spells them out. `Capabilities`
is what one compiled program offers, read once when it is loaded. The config JSON
that travels with the functions is `config.py`'s. Neither torch nor iree is imported
here, so both sides (and tests) can read it.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, replace
from pathlib import Path

from .config import KilnParams, ModelParams, PageGroups

# The scope of the parameters in the .irpa: the MLIR names them #flow.parameter.named<"model"::...>.
PARAMETER_SCOPE = "model"

MLIR_FILE = "model.mlir"
PARAMETERS_FILE = "model.irpa"
CONFIG_FILE = "model.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
TARGETS = ("cpu", "cuda", "rocm")


def vmfb_file(target: str) -> str:
    """The compiled module for one target: model_cpu.vmfb, model_cuda.vmfb, model_rocm.vmfb."""
    return f"model_{target}.vmfb"


def device_target(device: str) -> str:
    """The compile target whose module a HAL device runs: local-task/local-sync -> cpu,
    cuda -> cuda, hip -> rocm."""
    if device.startswith("local"):
        return "cpu"
    return "cuda" if device.startswith("cuda") else "rocm"


class FunctionKind(str, enum.Enum):
    PREFILL = "prefill"  # logits [N, T, V] at every position (shortfin's)
    PREFILL_LAST = "prefill_last"  # the same call, logits [N, 1, V] at each row's last token (Kiln's)
    DECODE = "decode"  # one token per row, logits [N, 1, V]
    # A diffusion LM's forward: T tokens from start_pos, each seeing every key below seq_len
    # (no causal mask), K/V written into the pages as prefill does; logits [N, T, V].
    DENOISE = "denoise"
    # The same pass reduced to what a greedy sampler reads, [N, T, 4]: per position the most
    # likely token (as a float), its probability, the second's, and the negative entropy, the
    # mask token left out. A 4-wide result instead of the vocabulary's width.
    DENOISE_TOP = "denoise_top"
    # Prefill's pass (its arguments, K/V written into the pages) returning the final hidden
    # states [N, T, H] after the last norm, for embeddings to pool (runtime/pooling.py).
    EMBED = "embed"
    # A step's logits [N, 1, V] (decode's, prefill_last's) and each row's temperature, top-k,
    # top-p, min-p and uniform number, to the token ids [N] the host sampler would choose for
    # them, on the device (export/device_sampling.py).
    SAMPLE = "sample"


_PREFILL_ARGUMENTS = ("tokens", "start_pos", "seq_lens", "seq_block_ids", "cache")
_PREFILL_ARGUMENTS_NO_POSITION = ("tokens", "seq_lens", "seq_block_ids", "cache")
_DECODE_ARGUMENTS = ("tokens", "seq_lens", "start_positions", "seq_block_ids", "cache")
_SAMPLE_ARGUMENTS = ("logits", "temperature", "top_k", "top_p", "min_p", "uniform")
_FUNCTION_NAME = re.compile(r"^(prefill_last|prefill|decode|denoise_top|denoise|embed|sample)_bs([1-9][0-9]*)$")
_FIXED_DECODE_NAME = re.compile(r"^decode_bs([1-9][0-9]*)_ctx([1-9][0-9]*)$")
DIFFUSION = "diffusion"  # KilnParams.model_kind of a diffusion LM's export


def function_name(kind: FunctionKind, batch_size: int) -> str:
    return f"{FunctionKind(kind).value}_bs{batch_size}"


def fixed_decode_name(batch_size: int, context: int) -> str:
    """decode_bs<N>_ctx<T>: decode_bs<N> with every shape fixed, for rows of at most T tokens (a
    block table T / stride wide) over a cache of exactly the config's device_block_count pages.
    Nothing in it is dynamic, so IREE records its command buffer once, when the module loads,
    rather than on every call."""
    return f"{function_name(FunctionKind.DECODE, batch_size)}_ctx{context}"


def fixed_decode_context(name: str) -> int | None:
    """T of a fixed-shape decode's name, decode_bs<N>_ctx<T>; None for any other name."""
    match = _FIXED_DECODE_NAME.match(name)
    return int(match.group(2)) if match else None


def parse_function_name(name: str) -> tuple[FunctionKind, int] | None:
    """(kind, batch size) of an ABI function's name (a fixed-shape decode's included); None for
    any other name."""
    if match := _FIXED_DECODE_NAME.match(name):
        return FunctionKind.DECODE, int(match.group(1))
    match = _FUNCTION_NAME.match(name)
    return (FunctionKind(match.group(1)), int(match.group(2))) if match else None


def argument_names(kind: FunctionKind, has_prefill_position: bool, lora: bool = False) -> tuple[str, ...]:
    """The arguments of a function of `kind`, in call order; the cache (updated in place) is last.

    tokens [N, T] i64 (T a multiple of the stride for prefill, 1 for decode), start
    positions [N] i64, sequence lengths [N] i64, the block table [N, B] i64, the cache
    [pages, page_elems]. Without start positions, prefill writes each row from position 0.
    A multi-device export (runtime/device_layout.py) takes the cache as one buffer per device,
    in device order, where this lists one.
    Denoise takes prefill's arguments, with any T (a window need not fill whole pages); embed
    takes prefill's. With LoRA adapters, each row's adapter slot [N] i64 and the slots' stacked
    weights (A then B per adapted module, models/lora.py) come before the cache. Sample takes a
    step's logits [N, 1, V] f32, then temperature [N] f32, top_k [N] i64, top_p, min_p and
    uniform [N] f32, and no cache.
    """
    if FunctionKind(kind) is FunctionKind.SAMPLE:
        return _SAMPLE_ARGUMENTS
    if FunctionKind(kind) is FunctionKind.DECODE:
        names = _DECODE_ARGUMENTS
    elif FunctionKind(kind) in (FunctionKind.DENOISE, FunctionKind.DENOISE_TOP):
        names = _PREFILL_ARGUMENTS
    else:
        names = _PREFILL_ARGUMENTS if has_prefill_position else _PREFILL_ARGUMENTS_NO_POSITION
    return names[:-1] + ("lora_slots", "lora_weights", "cache") if lora else names


def expected_functions(params: ModelParams, with_prefill_last: bool, kiln: KilnParams | None = None) -> list[str]:
    """Every function an export with this config contains, in export order."""
    if kiln is not None and kiln.model_kind == DIFFUSION:
        kinds = [FunctionKind.DENOISE] + ([FunctionKind.DENOISE_TOP] if kiln.denoise_top else [])
        return [function_name(kind, bs) for kind in kinds for bs in kiln.denoise_batch_sizes]
    kinds = [FunctionKind.PREFILL] + ([FunctionKind.PREFILL_LAST] if with_prefill_last else [])
    names = [function_name(kind, bs) for kind in kinds for bs in params.prefill_batch_sizes]
    names += [function_name(FunctionKind.DECODE, bs) for bs in params.decode_batch_sizes]
    buckets = kiln.decode_buckets if kiln is not None else ()
    names += [fixed_decode_name(bs, context) for bs in params.decode_batch_sizes for context in buckets]
    names += [function_name(FunctionKind.EMBED, bs) for bs in (kiln.embed_batch_sizes if kiln else ())]
    return names + [function_name(FunctionKind.SAMPLE, bs) for bs in (kiln.sample_batch_sizes if kiln else ())]


@dataclass(frozen=True)
class Artifacts:
    """The files of one compiled export."""

    vmfb: Path
    params: Path
    config: Path
    tokenizer: Path | None = None

    @classmethod
    def in_directory(cls, directory: Path, target: str = "cpu") -> "Artifacts":
        directory = Path(directory)
        return cls(
            vmfb=directory / vmfb_file(target),
            params=directory / PARAMETERS_FILE,
            config=directory / CONFIG_FILE,
            tokenizer=directory / TOKENIZER_FILE,
        )

    @property
    def tokenizer_path(self) -> Path:
        return Path(self.tokenizer) if self.tokenizer else Path(self.config).with_name(TOKENIZER_FILE)

    def with_tokenizer(self, tokenizer: Path) -> "Artifacts":
        return replace(self, tokenizer=Path(tokenizer))


class ContractError(ValueError):
    """A compiled program that lacks what its config promises, or offers what Kiln cannot call."""


@dataclass(frozen=True)
class Capabilities:
    """What one compiled program offers: derived once from its config and its function table."""

    prefill_batch_sizes: tuple[int, ...]
    decode_batch_sizes: tuple[int, ...]
    prefill_last_batch_sizes: tuple[int, ...]  # sizes with a prefill_last companion
    has_prefill_position: bool  # prefill takes start positions: chunked prefill and prefix reuse
    prefill_returns_last_only: bool  # prefill_bs<N> itself returns [N, 1, V] (--prefill-final-logits)
    block_seq_stride: int
    max_seq_len: int
    # A diffusion LM's: denoise sizes, the mask token, the logits shift (empty/None/0 for others).
    denoise_batch_sizes: tuple[int, ...] = ()
    has_denoise_top: bool = False  # denoise_top_bs<N> for every denoise size
    mask_token_id: int | None = None
    logits_shift: int = 0
    # Context lengths with a fixed-shape decode (fixed_decode_name) for every decode size, and
    # the cache's page count those take.
    decode_buckets: tuple[int, ...] = ()
    fixed_page_count: int = 0
    # Sizes with an embed_bs<N> (hidden states for embeddings), their width; none: no embeddings.
    embed_batch_sizes: tuple[int, ...] = ()
    hidden_size: int = 0
    # LoRA adapter slots the functions take (0: none), of ranks up to lora_rank, over lora_layers
    # layers; each adapted module's (name, in, out), in the order of their stacked weights.
    lora_slots: int = 0
    lora_rank: int = 0
    lora_layers: int = 0
    lora_modules: tuple[tuple[str, int, int], ...] = ()
    # Sizes with a sample_bs<N>, which chooses a decode's or prefill_last's tokens on the device.
    sample_batch_sizes: tuple[int, ...] = ()
    # A model whose pages hold one group of layers each (config.PageGroups); None: every layer.
    page_groups: PageGroups | None = None

    @property
    def is_diffusion(self) -> bool:
        return bool(self.denoise_batch_sizes)

    @classmethod
    def of(cls, params: ModelParams, kiln: KilnParams, function_names) -> "Capabilities":
        """Check the functions against the config; raise ContractError naming what is missing."""
        present = set(function_names)
        missing = [name for name in expected_functions(params, False, kiln) if name not in present]
        if missing:
            raise ContractError(f"the module has no function {missing[0]} that the config lists")
        diffusion = kiln.model_kind == DIFFUSION
        if diffusion and (not kiln.denoise_batch_sizes or kiln.mask_token_id is None):
            raise ContractError("a diffusion export's config must list denoise batch sizes and the mask token")
        if params.top_k is not None:
            raise ContractError("its functions return top-k values and ids, which Kiln does not serve: "
                                "export without --top-k")
        last = tuple(sorted(bs for bs in params.prefill_batch_sizes
                            if function_name(FunctionKind.PREFILL_LAST, bs) in present))
        return cls(
            prefill_batch_sizes=tuple(sorted(params.prefill_batch_sizes)),
            decode_batch_sizes=tuple(sorted(params.decode_batch_sizes)),
            prefill_last_batch_sizes=last,
            has_prefill_position=params.has_prefill_position,
            prefill_returns_last_only=kiln.prefill_final_logits,
            block_seq_stride=params.block_seq_stride,
            max_seq_len=params.max_seq_len,
            denoise_batch_sizes=tuple(sorted(kiln.denoise_batch_sizes)) if diffusion else (),
            has_denoise_top=diffusion and kiln.denoise_top,
            mask_token_id=kiln.mask_token_id if diffusion else None,
            logits_shift=kiln.logits_shift if diffusion else 0,
            decode_buckets=() if diffusion else tuple(sorted(kiln.decode_buckets)),
            fixed_page_count=params.paged_kv_cache.device_block_count,
            embed_batch_sizes=() if diffusion else tuple(sorted(kiln.embed_batch_sizes)),
            hidden_size=kiln.hidden_size,
            lora_slots=kiln.lora.get("slots", 0),
            lora_rank=kiln.lora.get("rank", 0),
            lora_layers=kiln.lora.get("layers", 0),
            lora_modules=tuple((name, fin, fout) for name, (fin, fout) in kiln.lora.get("modules", {}).items()),
            sample_batch_sizes=() if diffusion else tuple(sorted(kiln.sample_batch_sizes)),
            page_groups=PageGroups.from_json(kiln.page_groups) if kiln.page_groups else None,
        )

    @property
    def every_position_logits(self) -> bool:
        """Whether some prefill returns the logits at every position (what prompt logprobs need)."""
        return not self.prefill_returns_last_only

    def decode_function(self, batch_size: int, context: int, page_count: int) -> tuple[str, int]:
        """The decode to call for a batch whose longest row holds `context` tokens over a cache of
        `page_count` pages, and how many blocks wide its table is.

        The smallest fixed-shape bucket that holds the context, where the cache has the page
        count those were exported for (each call then replays a command buffer recorded once);
        decode_bs<N> with a table just wide enough otherwise.
        """
        if page_count == self.fixed_page_count:
            for bucket in self.decode_buckets:
                if context <= bucket:
                    return fixed_decode_name(batch_size, bucket), bucket // self.block_seq_stride
        return function_name(FunctionKind.DECODE, batch_size), -(-context // self.block_seq_stride)

    def prefill_function(self, batch_size: int, every_position: bool) -> tuple[str, bool]:
        """The prefill to call for a batch, and whether it returns only each row's last logits.

        prefill_last_bs<N> where it exists and no row needs every position: it skips the
        [N, T, V] output projection a sampler never reads.
        """
        if self.prefill_returns_last_only:
            return function_name(FunctionKind.PREFILL, batch_size), True
        if not every_position and batch_size in self.prefill_last_batch_sizes:
            return function_name(FunctionKind.PREFILL_LAST, batch_size), True
        return function_name(FunctionKind.PREFILL, batch_size), False
