"""`kiln export-model`'s work: checkpoint in, model.mlir/json/irpa + tokenizer out.

Everything is written into a scratch directory beside the output and moved into
place at the end, model.json last, so an interrupted export never leaves a
directory that looks complete.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kiln.models.checkpoint import Checkpoint
from kiln.models.config import SLIDING
from kiln.models.llama import PagedLlama
from kiln.models.lora import attach_lora, lora_shapes
from kiln.models.meta_load import load_streamed
from kiln.models.quantize import FLOAT32, quantize_model
from kiln.models.registry import family_named
from kiln.models.sharded_llama import ShardedPagedLlama
from kiln.models.stacked_projections import stack_attention_projections
from kiln.runtime.config import (BYTE_KV_CACHE_DTYPES, KV_SCALE_BYTES, KilnParams, ModelParams, PagedKVCacheParams,
                                 PageGroups, save_model_config, sidecar_path)
from kiln.runtime.contract import (
    CONFIG_FILE, DIFFUSION, MLIR_FILE, PARAMETER_SCOPE, PARAMETERS_FILE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE,
)
from kiln.runtime.errors import ExportError, ModelLoadError

from . import cpu_attention, lora_kernel
from .cpu_kernels import OBJECT_FILE, build_object, row_matmul_kernel, support_problem
from .exporter import TORCH_DTYPES, trace_module
from .options import ExportOptions
from .page_gather import gather_pages
from .parameter_file import Spill, return_freed_memory, save_parameters
from .weight_matmul import weight_matmul_kernel

ARTIFACT_NAMES = (MLIR_FILE, PARAMETERS_FILE, TOKENIZER_FILE, TOKENIZER_CONFIG_FILE)


@dataclass
class ExportedModel:
    directory: Path

    @property
    def mlir(self) -> Path:
        return self.directory / MLIR_FILE

    @property
    def irpa(self) -> Path:
        return self.directory / PARAMETERS_FILE

    @property
    def config(self) -> Path:
        return self.directory / CONFIG_FILE

    @property
    def tokenizer(self) -> Path:
        return self.directory / TOKENIZER_FILE


def model_params(checkpoint: Checkpoint, options: ExportOptions) -> ModelParams:
    c = checkpoint.config
    diffusion = c.is_diffusion  # no prefill or decode: its functions are in KilnParams
    return ModelParams(
        max_seq_len=options.max_seq_len,
        transformer_block_count=c.num_hidden_layers,
        attn_head_dim=c.head_dim,
        prefill_batch_sizes=[] if diffusion else list(options.prefill_batch_sizes),
        decode_batch_sizes=[] if diffusion else list(options.decode_batch_sizes),
        has_prefill_position=options.has_prefill_position,
        logits_normalization=options.logits_normalization,
        attn_dtype=options.dtype,
        top_k=options.top_k,
        paged_kv_cache=PagedKVCacheParams(
            block_seq_stride=options.block_seq_stride,
            attention_head_count_kv=c.num_key_value_heads,
            device_block_count=options.device_block_count,
            kv_cache_dtype=options.cache_dtype,
        ),
    )


def kiln_params(checkpoint: Checkpoint, options: ExportOptions) -> KilnParams:
    c = checkpoint.config
    kiln = KilnParams(
        vocab_size=c.vocab_size,
        eos_token_ids=list(c.eos_token_ids),
        prefill_final_logits=options.prefill_final_logits,
        tensor_parallel=options.tensor_parallel,
        pipeline_parallel=options.pipeline_parallel,
        quantization=options.quantize,
        decode_buckets=list(options.decode_buckets or ()),
        generation_defaults=dict(checkpoint.generation_defaults),
        hidden_size=c.hidden_size,
    )
    if options.lora_slots:
        kiln = replace(kiln, lora={"slots": options.lora_slots, "rank": options.lora_rank,
                                   "layers": c.num_hidden_layers,
                                   "modules": {m: list(shape) for m, shape in
                                               lora_shapes(c, options.lora_modules).items()}})
    if not c.is_diffusion:
        kiln = replace(kiln, sample_batch_sizes=list(options.sample_batch_sizes))
    if groups := page_groups_for(checkpoint, options):
        kiln = replace(kiln, page_groups=groups.to_json())
    if options.embedding_functions and not c.is_diffusion:
        kiln = replace(kiln, embed_batch_sizes=list(options.prefill_batch_sizes),
                       embedding=checkpoint.embedding.to_json())
    if c.is_diffusion:
        kiln = replace(kiln, prefill_final_logits=False, model_kind=DIFFUSION,
                       denoise_batch_sizes=list(options.denoise_batch_sizes), denoise_top=options.denoise_top_functions,
                       mask_token_id=c.mask_token_id, logits_shift=c.logits_shift)
    return kiln


def attention_in_place(checkpoint: Checkpoint, options: ExportOptions) -> bool:
    """Whether decode attention reads the KV pages in place (the CPU kernel) rather than gathering them."""
    return (options.cpu_kernels and options.attention_in_place
            and cpu_attention.supports(checkpoint.config, options.block_seq_stride, options.cache_dtype))


def with_decode_buckets(checkpoint: Checkpoint, options: ExportOptions) -> ExportOptions:
    """The options with their decode buckets chosen (ExportOptions.decode_buckets): where none
    were asked for, one of max_seq_len if every layer's attention reads the pages in place, since
    a wider table costs that kernel nothing, and none otherwise."""
    if checkpoint.config.is_diffusion:
        if options.decode_buckets:
            raise ExportError("decode buckets do not apply to a diffusion LM: it has no decode functions")
        return replace(options, decode_buckets=())
    if options.decode_buckets is not None:
        return options
    c = checkpoint.config
    # A local (sliding-window) or soft-capped layer gathers the table's pages even beside the
    # kernel: a table as wide as the context would cost it every page on every step.
    gathered_layers = SLIDING in c.layer_types or c.attn_logit_softcapping is not None
    in_place = attention_in_place(checkpoint, options) and not gathered_layers
    return replace(options, decode_buckets=(options.max_seq_len,) if in_place else ())


def page_groups_for(checkpoint: Checkpoint, options: ExportOptions) -> PageGroups | None:
    """The page groups of a model with sliding-window layers (runtime/config.py's PageGroups), so
    that the runtime may let a block's pages for those layers go once it has left their window;
    None, every layer in every page, where nothing would leave: no window shorter than the context,
    or a model spread over devices (whose pages are cut by layers and heads already)."""
    c = checkpoint.config
    if (SLIDING not in c.layer_types or not c.sliding_window or c.sliding_window >= options.max_seq_len
            or c.is_diffusion or options.layout.device_count > 1):
        return None
    return PageGroups.of([kind == SLIDING for kind in c.layer_types], c.sliding_window)


def build_model(checkpoint: Checkpoint, options: ExportOptions, spill: Spill | None = None
                ) -> PagedLlama | ShardedPagedLlama:
    """The model to trace: one device's, built on the meta device and filled in a weight at a time
    as each is quantized (models/meta_load.py), each moved to `spill`'s file once made, or cut and
    placed over the options' device layout."""
    in_place = attention_in_place(checkpoint, options)
    module = family_named(checkpoint.config.architecture).module_class()
    groups = page_groups_for(checkpoint, options)

    def new_model() -> PagedLlama:
        model = module(checkpoint.config, block_seq_stride=options.block_seq_stride, gather_pages=gather_pages,
                       decode_attention=cpu_attention.KERNELS[options.cache_dtype] if in_place else None,
                       **({"page_groups": groups} if groups else {}))
        for layer in model.model.layers:
            layer.self_attn.fused = options.attention == "fused"
        return model

    dtype = TORCH_DTYPES[options.dtype]
    mode, matmul = options.quantize, weight_matmul_kernel
    if options.cpu_kernels:
        mode = FLOAT32 if options.quantize == "none" and options.dtype == "float32" else options.quantize
        matmul = row_matmul_kernel
    try:
        if options.layout.device_count > 1:  # each device's share is cut from the whole model
            model = ShardedPagedLlama(new_model().load_tensors(checkpoint.tensors, dtype=dtype), options.layout)
            model = quantize_model(model, mode, matmul, checkpoint.blocks)
        else:
            model = load_streamed(new_model, checkpoint.tensors, dtype,
                                  lambda model, load: quantize_model(model, mode, matmul, checkpoint.blocks, load),
                                  optional=("lm_head.weight",), spill=spill.spill if spill else None)
    except ModelLoadError:
        raise
    except (ValueError, RuntimeError) as error:
        raise ExportError(f"the checkpoint's tensors do not fit its config: {error}") from None
    model = model.eval()
    if options.lora_slots:  # after quantizing: the adapters' deltas stay float32 beside any storage
        features = list(lora_shapes(checkpoint.config, options.lora_modules).values())
        in_place = options.cpu_kernels and lora_kernel.supports(features, options.lora_rank)
        model.lora_inputs = attach_lora(model, options.lora_modules, lora_kernel.lora_delta if in_place else None)
    stack_attention_projections(model)
    if spill is not None:
        spill.spill(model)
    return model


def export_model(checkpoint: Checkpoint, options: ExportOptions, output_dir: Path, log=print) -> ExportedModel:
    options = options.validate(checkpoint.config.max_position_embeddings, checkpoint.stored_quantization)
    options = with_decode_buckets(checkpoint, options)
    c = checkpoint.config
    if c.is_diffusion and options.top_k is not None:
        raise ExportError("--top-k does not apply to a diffusion LM: its sampler reads every masked position")
    if options.embedding_functions and c.is_diffusion:
        raise ExportError("--embeddings applies to autoregressive models: a diffusion LM's hidden states see "
                          "both ways")
    if options.lora_slots and c.is_diffusion:
        raise ExportError("LoRA adapters apply to autoregressive models")
    if options.lora_slots and c.num_experts and {"gate_proj", "up_proj", "down_proj"} & set(options.lora_modules):
        raise ExportError("LoRA adapters on a mixture-of-experts model adapt its attention only: pass --lora-modules "
                          "from q_proj, k_proj, v_proj, o_proj")
    if options.cache_dtype in BYTE_KV_CACHE_DTYPES and c.head_dim % KV_SCALE_BYTES:
        raise ExportError(f"--kv-cache-dtype {options.cache_dtype} keeps a page's scales in rows of half a head: it "
                          f"needs an even head_dim, the model's is {c.head_dim}")
    if options.embedding_functions and checkpoint.embedding.unsupported:
        raise ExportError(f"--embeddings: this model's embeddings cannot be served as it defines them: "
                          f"{checkpoint.embedding.unsupported}")
    problem = options.layout.problem(c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
                                     c.intermediate_size)
    if not problem and c.num_experts:  # each expert's columns are split too
        problem = options.layout.problem(c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
                                         c.moe_intermediate_size)
    if problem:
        raise ExportError(problem)
    if options.cpu_kernels and (problem := support_problem()):
        raise ExportError(f"--cpu-kernels: {problem}")
    output_dir = Path(output_dir)
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.partial-", dir=output_dir.parent))
    try:
        started = time.monotonic()
        spilled = Spill(scratch / "weights.spill")
        model = build_model(checkpoint, options, spilled)
        return_freed_memory()
        built = (f"the {options.dtype} model" if options.quantize == "none"
                 else f"the model ({options.quantize} weights, {options.dtype} activations)")
        log(f"built {built} in {time.monotonic() - started:.1f}s")

        started = time.monotonic()
        save_parameters(model, scratch / PARAMETERS_FILE, PARAMETER_SCOPE, spilled)
        return_freed_memory()
        log(f"saved parameters ({(scratch / PARAMETERS_FILE).stat().st_size / 2**20:.1f} MiB) "
            f"in {time.monotonic() - started:.1f}s")

        log("tracing:")
        started = time.monotonic()
        with torch.no_grad(), warnings.catch_warnings():
            # torch.export's own deprecation chatter (LeafSpec), not ours to act on.
            warnings.filterwarnings("ignore", category=FutureWarning)
            trace_module(model, options, scratch, scratch / MLIR_FILE, log=log)
        log(f"wrote {MLIR_FILE} in {time.monotonic() - started:.1f}s")

        if options.cpu_kernels:
            build_object(scratch)
            log(f"compiled the CPU kernels into {OBJECT_FILE}")
        (scratch / TOKENIZER_FILE).write_text(checkpoint.tokenizer_json)
        (scratch / TOKENIZER_CONFIG_FILE).write_text(json.dumps(checkpoint.tokenizer_config, indent=2) + "\n")
        save_model_config(scratch / CONFIG_FILE, model_params(checkpoint, options), kiln_params(checkpoint, options))

        output_dir.mkdir(parents=True, exist_ok=True)
        # A stale model.json must not vouch for half-replaced files.
        (output_dir / CONFIG_FILE).unlink(missing_ok=True)
        (output_dir / OBJECT_FILE).unlink(missing_ok=True)
        kernels = (OBJECT_FILE,) if options.cpu_kernels else ()
        for name in (*ARTIFACT_NAMES, *kernels, sidecar_path(Path(CONFIG_FILE)).name, CONFIG_FILE):
            os.replace(scratch / name, output_dir / name)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return ExportedModel(output_dir)
