"""Trace a PagedLlama into one MLIR module of prefill_bs<N> / decode_bs<N> functions
(denoise_bs<N> for a diffusion LM; embed_bs<N> where embeddings are asked for; sample_bs<N>
where tokens are chosen on the device).

Names and argument orders are the contract's (runtime/contract.py), which follows
shortfin's ABI. Token length, block count and the cache's page count are dynamic, so
one VMFB serves any prompt length up to max_seq_len and any cache size the runtime
chooses. Beside each decode_bs<N>, one decode per context bucket with every shape fixed
(decode_bs<N>_ctx<T>), whose command buffer IREE records once rather than on every call.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from iree.turbine import aot
from torch.export import Dim

from kiln.models.llama import MASKED_SCORE, PagedLlama
from kiln.models.lora import stacked_lora_examples
from kiln.models.sharded_llama import ShardedPagedLlama
from kiln.runtime.config import kv_storage_dtype
from kiln.runtime.contract import FunctionKind, argument_names, fixed_decode_name, function_name

from .device_sampling import sample_tokens
from .fast_trace import answer_dialect_lookups, fast_tracing
from .options import ExportOptions
from .trace_workers import trace_in_processes, tracing_processes, write_merged_module

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int8": torch.int8,
                "fp8_e4m3": torch.float8_e4m3fn}


def select_logits(model: PagedLlama, options: ExportOptions, h, start_pos, seq_lens, final_only=None):
    """Turn hidden states into what the function returns: logits, or top-k values and ids.

    `final_only` (default: the export's prefill_final_logits) keeps only each row's last
    real position, skipping the [N, T, V] projection a sampler never reads.
    """
    final_only = options.prefill_final_logits if final_only is None else final_only
    if final_only and h.shape[1] != 1:
        last = torch.clamp(seq_lens - 1 - start_pos, min=0, max=h.shape[1] - 1)
        h = torch.gather(h, 1, last.view(-1, 1, 1).expand(-1, 1, h.shape[2]))
    logits = model.logits(h)
    if options.logits_normalization == "softmax":
        logits = torch.softmax(logits, dim=-1)
    elif options.logits_normalization == "log_softmax":
        logits = torch.log_softmax(logits, dim=-1)
    if options.top_k is None:
        return logits
    if options.top_k == 1:
        values, indices = torch.max(logits, dim=-1, keepdim=True)
        return values, indices
    return torch.topk(logits, options.top_k, dim=-1)


def greedy_summary(logits, mask_token_id: int):
    """[N, T, 4] from logits [N, T, V]: the most likely token (a float: exact below 2^24), its
    probability, the runner-up's, and sum(p log p), the mask token left out, as the runtime's
    commit rules compute them from full logits."""
    vocab = torch.arange(logits.shape[-1])
    probs = torch.softmax(logits + (vocab == mask_token_id).float() * MASKED_SCORE, dim=-1)
    # Two max-reductions rather than topk, whose llvm-cpu code took 290 s for one batch-1,
    # 32-token block on SmolLM2's vocabulary (these take 2.5 s; denoise alone 0.07 s). The
    # runner-up is the best of the rest.
    top1, best = probs.max(dim=-1, keepdim=True)
    top2 = torch.where(vocab == best, -1.0, probs).amax(dim=-1, keepdim=True)
    negative_entropy = (probs * torch.log(probs + 1e-10)).sum(dim=-1, keepdim=True)
    return torch.cat([best.float(), top1, top2, negative_entropy], dim=-1)


def abi_functions(options: ExportOptions, final_only: bool) -> dict[FunctionKind, object]:
    """The traced bodies by kind; their parameters (after the model) are the contract's argument names."""

    def prefill(model, tokens, start_pos, seq_lens, seq_block_ids, cache, final_only=final_only):
        h = model.forward_paged(tokens, start_pos, seq_lens, seq_block_ids, cache)
        return select_logits(model, options, h, start_pos, seq_lens, final_only)

    def prefill_without_position(model, tokens, seq_lens, seq_block_ids, cache, final_only=final_only):
        start_pos = torch.zeros_like(seq_lens)
        h = model.forward_paged(tokens, start_pos, seq_lens, seq_block_ids, cache)
        return select_logits(model, options, h, start_pos, seq_lens, final_only)

    def decode(model, tokens, seq_lens, start_positions, seq_block_ids, cache):
        h = model.forward_paged(tokens, start_positions, seq_lens, seq_block_ids, cache)
        return select_logits(model, options, h, start_positions, seq_lens)

    def embed(model, tokens, start_pos, seq_lens, seq_block_ids, cache):
        return model.model.norm(model.forward_paged(tokens, start_pos, seq_lens, seq_block_ids, cache)).float()

    def embed_without_position(model, tokens, seq_lens, seq_block_ids, cache):
        return embed(model, tokens, torch.zeros_like(seq_lens), seq_lens, seq_block_ids, cache)

    def denoise(model, tokens, start_pos, seq_lens, seq_block_ids, cache):
        return model.logits(model.forward_paged(tokens, start_pos, seq_lens, seq_block_ids, cache))

    def denoise_top(model, tokens, start_pos, seq_lens, seq_block_ids, cache):
        return greedy_summary(denoise(model, tokens, start_pos, seq_lens, seq_block_ids, cache),
                              model.config.mask_token_id)

    return {
        FunctionKind.PREFILL: prefill if options.has_prefill_position else prefill_without_position,
        FunctionKind.DECODE: decode,
        FunctionKind.DENOISE: denoise,
        FunctionKind.DENOISE_TOP: denoise_top,
        FunctionKind.EMBED: embed if options.has_prefill_position else embed_without_position,
    }


def with_lora(bodies: dict[FunctionKind, object], has_prefill_position: bool) -> dict[FunctionKind, object]:
    """The bodies taking each row's adapter slot and the stacked adapter weights before the cache
    (the contract's order), which they bind to the model's LoraInputs (models/lora.py) first."""

    def prefill(model, tokens, start_pos, seq_lens, seq_block_ids, lora_slots, lora_weights, cache):
        model.lora_inputs.bind(lora_slots, lora_weights)
        return bodies[FunctionKind.PREFILL](model, tokens, start_pos, seq_lens, seq_block_ids, cache)

    def prefill_without_position(model, tokens, seq_lens, seq_block_ids, lora_slots, lora_weights, cache):
        model.lora_inputs.bind(lora_slots, lora_weights)
        return bodies[FunctionKind.PREFILL](model, tokens, seq_lens, seq_block_ids, cache)

    def embed(model, tokens, start_pos, seq_lens, seq_block_ids, lora_slots, lora_weights, cache):
        model.lora_inputs.bind(lora_slots, lora_weights)
        return bodies[FunctionKind.EMBED](model, tokens, start_pos, seq_lens, seq_block_ids, cache)

    def embed_without_position(model, tokens, seq_lens, seq_block_ids, lora_slots, lora_weights, cache):
        model.lora_inputs.bind(lora_slots, lora_weights)
        return bodies[FunctionKind.EMBED](model, tokens, seq_lens, seq_block_ids, cache)

    def decode(model, tokens, seq_lens, start_positions, seq_block_ids, lora_slots, lora_weights, cache):
        model.lora_inputs.bind(lora_slots, lora_weights)
        return bodies[FunctionKind.DECODE](model, tokens, seq_lens, start_positions, seq_block_ids, cache)

    return {
        FunctionKind.PREFILL: prefill if has_prefill_position else prefill_without_position,
        FunctionKind.DECODE: decode,
        FunctionKind.EMBED: embed if has_prefill_position else embed_without_position,
    }


def device_affinities(names: tuple[str, ...], cache) -> dict[int, aot.DeviceAffinity] | None:
    """Where a multi-device function's cache buffers live (the flattened argument order puts the
    cache list last): each on its own device. Device 0's arguments (the request's arrays and its
    cache buffer) are left to the module's default device, which is device 0: on IREE 3.13 any
    argument given an explicit device-0 affinity makes every cache buffer be copied on each call
    rather than updated in place (measured: 10-15 ms per call at 8,192 pages of the tiny model,
    against 0.4 ms). The parameters carry their devices, which the affinity analysis needs."""
    if not isinstance(cache, list):
        return None
    first_cache = names.index("cache")
    return {first_cache + device: aot.DeviceAffinity(device) for device in range(1, len(cache))}


def dynamic_examples(kind: FunctionKind, bs: int, options: ExportOptions, groups: int = 0) -> dict[str, tuple]:
    """Example arguments (all but the cache) and their dynamic dimensions for a function of
    `kind` and batch size `bs`: any token length (prefill, denoise) and block count."""
    stride = options.block_seq_stride
    max_blocks = options.max_seq_len // stride
    blocks = Dim("blocks", min=1, max=max_blocks)
    # The example shapes must differ from one another and from 1, or export
    # specializes them as equal.
    if kind is FunctionKind.DECODE:
        tokens, tokens_dims = torch.zeros(bs, 1, dtype=torch.int64), {}
    elif kind in (FunctionKind.DENOISE, FunctionKind.DENOISE_TOP):
        # Any length: a dual-cache window is one block, which need not fill whole pages.
        tokens = torch.zeros(bs, 2 * stride + 1, dtype=torch.int64)
        tokens_dims = {1: Dim("window", min=2, max=options.max_seq_len)}
    else:
        token_blocks = Dim("token_blocks", min=1, max=max_blocks)
        tokens, tokens_dims = torch.zeros(bs, 2 * stride, dtype=torch.int64), {1: token_blocks * stride}
    return {
        "tokens": (tokens, tokens_dims),
        "start_pos": (torch.zeros(bs, dtype=torch.int64), {}),
        "start_positions": (torch.zeros(bs, dtype=torch.int64), {}),
        "seq_lens": (torch.ones(bs, dtype=torch.int64), {}),
        "seq_block_ids": block_table(bs, 3, groups, blocks),
    }


def block_table(bs: int, blocks: int, groups: int, dim=None) -> tuple[torch.Tensor, dict]:
    """An example table of `blocks` pages a row ([bs, groups, blocks] for a model with page groups,
    models/llama.py) and its dynamic block axis, if `dim`."""
    if groups:
        return torch.zeros(bs, groups, blocks, dtype=torch.int64), {2: dim} if dim is not None else {}
    return torch.zeros(bs, blocks, dtype=torch.int64), {1: dim} if dim is not None else {}


def sample(model, logits, temperature, top_k, top_p, min_p, uniform):
    """sample_bs<N>'s body: the model's weights play no part."""
    return sample_tokens(logits, temperature, top_k, top_p, min_p, uniform)


def sample_examples(bs: int, vocab_size: int) -> dict[str, tuple]:
    """sample_bs<N>'s arguments (static shapes): a step's last logits and each row's settings."""
    row = (torch.zeros(bs, dtype=torch.float32), {})
    return {"logits": (torch.zeros(bs, 1, vocab_size, dtype=torch.float32), {}), "temperature": row,
            "top_k": (torch.zeros(bs, dtype=torch.int64), {}), "top_p": row, "min_p": row, "uniform": row}


def example_cache(model: PagedLlama | ShardedPagedLlama, pages: int, dtype: torch.dtype):
    """A cache argument to trace a function with (each device's buffer, for a sharded model): its
    shape and type are all tracing reads, so it is left uninitialized and its memory never touched.
    A traced program keeps its example arguments: zero-filled ones of the export's page count held
    a whole cache per function (720 MiB each for SmolLM2's default build: 11 GB by the last one)."""
    elems = model.page_elems(dtype)
    if isinstance(elems, list):
        return [torch.empty(pages, part, dtype=dtype) for part in elems]
    return torch.empty(pages, elems, dtype=dtype)


def as_cache_dtype(cache, dtype: torch.dtype):
    """The cache (each device's buffer of a list) viewed as `dtype`: into or out of its storage type."""
    return [part.view(dtype) for part in cache] if isinstance(cache, list) else cache.view(dtype)


def reading_cache_as(body, dtype: torch.dtype):
    """`body` taking its last argument, the cache, in its storage type and viewing it as `dtype`
    (runtime/config.py's KV_STORAGE_DTYPES); the traced signature stays body's."""

    @functools.wraps(body)
    def viewed(model, *args):
        return body(model, *args[:-1], as_cache_dtype(args[-1], dtype))

    return viewed


def trace_function(fxb: aot.FxProgramsBuilder, body, name: str, names: tuple[str, ...], examples: dict, log) -> None:
    """Trace `body` as the module's function `name`, its arguments `names` given by `examples`
    (each a tensor, or the cache's list of them, with its dynamic dimensions)."""
    started = time.monotonic()
    fxb.export_program(
        body,
        name=name,
        args=tuple(examples[arg][0] for arg in names),
        dynamic_shapes={arg: examples[arg][1] for arg in names},
        strict=False,
        arg_device=device_affinities(names, examples["cache"][0]) if "cache" in examples else None,
    )
    log(f"  traced {name} in {time.monotonic() - started:.1f}s")


@dataclass(frozen=True)
class PlannedFunction:
    """One function of the module, as `trace_functions` traces it: `kind` the function's (its name's),
    `context` a fixed-shape decode's context length."""
    kind: FunctionKind
    batch_size: int
    final_only: bool = False
    context: int | None = None

    @property
    def name(self) -> str:
        if self.context is not None:
            return fixed_decode_name(self.batch_size, self.context)
        return function_name(self.kind, self.batch_size)

    @property
    def tracing_cost(self) -> float:
        """Its trace's time relative to a decode's, to trace the costliest first when several
        processes trace at once: a prefill's dynamic token count costs it three to four times a
        decode's (SmolLM2, benchmarks/NOTES.md "Build time"); sampling reads no weights."""
        return {FunctionKind.DECODE: 1.0, FunctionKind.SAMPLE: 0.2}.get(self.kind, 3.5)


def planned_functions(model: PagedLlama | ShardedPagedLlama, options: ExportOptions) -> list[PlannedFunction]:
    """Every function the contract lists for these options, in the module's order."""
    if model.config.is_diffusion:
        kinds = [(FunctionKind.DENOISE, False)]
        if options.denoise_top_functions:
            kinds.append((FunctionKind.DENOISE_TOP, False))
    else:
        kinds = [(FunctionKind.PREFILL, options.prefill_final_logits)]
        if options.prefill_last_functions and not options.prefill_final_logits:
            kinds.append((FunctionKind.PREFILL_LAST, True))
        kinds.append((FunctionKind.DECODE, True))
        if options.embedding_functions:
            kinds.append((FunctionKind.EMBED, False))
    planned = []
    for kind, final_only in kinds:
        sizes = {FunctionKind.DECODE: options.decode_batch_sizes, FunctionKind.DENOISE: options.denoise_batch_sizes,
                 FunctionKind.DENOISE_TOP: options.denoise_batch_sizes}.get(kind, options.prefill_batch_sizes)
        for bs in sizes:
            planned.append(PlannedFunction(kind, bs, final_only))
            if kind is FunctionKind.DECODE:
                planned += [PlannedFunction(kind, bs, final_only, context) for context in options.decode_buckets or ()]
    if not model.config.is_diffusion:
        planned += [PlannedFunction(FunctionKind.SAMPLE, bs) for bs in options.sample_batch_sizes]
    return planned


def trace_functions(model: PagedLlama | ShardedPagedLlama, options: ExportOptions, functions: list[PlannedFunction],
                    directory: Path, log=print) -> None:
    """Trace each of `functions` (of `planned_functions`) and import it to MLIR on its own, into
    `function_module_path(directory, planned)`: one traced program alive at a time (a prefill's
    holds 130 MiB for SmolLM2; all 14 of its default build's, 780 MiB)."""
    stride = options.block_seq_stride
    cache_dtype = TORCH_DTYPES[options.cache_dtype]
    storage = TORCH_DTYPES[kv_storage_dtype(options.cache_dtype)]
    example_pages = max(options.device_block_count, 4)
    lora = bool(options.lora_slots)
    page_groups = getattr(model, "page_groups", None)
    groups = page_groups.count if page_groups else 0
    lora_examples = {}
    if lora:  # static shapes: every slot's weights at the build's rank
        weights = stacked_lora_examples(model.config, options.lora_modules, options.lora_slots, options.lora_rank)
        lora_examples["lora_weights"] = (weights, [{}] * len(weights))

    answer_dialect_lookups()
    for planned in functions:
        kind, bs = planned.kind, planned.batch_size
        fxb = aot.FxProgramsBuilder(model)
        with fast_tracing(model):
            if kind is FunctionKind.SAMPLE:
                trace_function(fxb, sample, planned.name, argument_names(kind, options.has_prefill_position),
                               sample_examples(bs, model.config.vocab_size), log)
            else:
                traced_kind = FunctionKind.PREFILL if kind is FunctionKind.PREFILL_LAST else kind
                bodies = abi_functions(options, planned.final_only)
                if lora:
                    bodies = with_lora(bodies, options.has_prefill_position)
                body = bodies[traced_kind]
                if storage != cache_dtype:
                    body = reading_cache_as(body, cache_dtype)
                names = argument_names(traced_kind, options.has_prefill_position, lora)
                if planned.context is None:
                    pages = Dim("pages", min=2)
                    cache = as_cache_dtype(example_cache(model, example_pages, cache_dtype), storage)
                    examples = dynamic_examples(kind, bs, options, groups) | lora_examples
                    examples["cache"] = (cache, [{0: pages}] * len(cache) if isinstance(cache, list) else {0: pages})
                else:
                    cache = as_cache_dtype(example_cache(model, options.device_block_count, cache_dtype), storage)
                    examples = {name: (tensor, {}) for name, (tensor, _) in dynamic_examples(kind, bs, options, groups).items()}
                    examples |= lora_examples
                    examples["seq_block_ids"] = block_table(bs, planned.context // stride, groups)
                    examples["cache"] = (cache, [{}] * len(cache) if isinstance(cache, list) else {})
                if lora:
                    examples["lora_slots"] = (torch.zeros(bs, dtype=torch.int64), {})
                trace_function(fxb, body, planned.name, names, examples, log)
        # What export knows of each dynamic size (a token count is a multiple of the stride, at
        # least one block) reaches IREE as assumptions on it. Without them IREE's GPU code takes a
        # matmul whose row count may be 1 for a matrix-vector product and computes prefill row by
        # row, re-reading every weight per token (linear in the prompt; 13x eager PyTorch's time on
        # an H200); with them it tiles the rows and, in bf16, uses the tensor cores. The builds with
        # Kiln's CPU kernels take their one-token matmuls through the kernels and keep the code
        # they were measured with.
        aot.export(fxb, import_symbolic_shape_expressions=not options.cpu_kernels).save_mlir(
            function_module_path(directory, planned))


def function_module_path(directory: Path, planned: PlannedFunction) -> Path:
    return directory / f"{planned.name}.mlir"


def trace_module(model: PagedLlama | ShardedPagedLlama, options: ExportOptions, scratch: Path, mlir_path: Path,
                 log=print) -> None:
    """Export every function the contract lists for these options into one module at `mlir_path`,
    traced by as many processes at once as there are CPUs, a process for each function
    (export/trace_workers.py; one at a time on one CPU too, so that what a trace leaves in the
    heap never reaches iree-compile), each function imported on its own into `scratch` and the
    modules merged."""
    functions = planned_functions(model, options)
    started = time.monotonic()
    trace_in_processes(lambda one, one_log: trace_functions(model, options, one, scratch, one_log),
                       functions, lambda planned: planned.tracing_cost, tracing_processes(len(functions)), scratch,
                       log)
    log(f"  traced and imported to MLIR in {time.monotonic() - started:.1f}s")
    paths = [function_module_path(scratch, planned) for planned in functions]
    write_merged_module(paths, mlir_path)
    for path in paths:
        path.unlink()
