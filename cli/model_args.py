"""Which compiled model to run: explicit files, an artifacts directory, or a model to build.

Shared by `kiln generate` and `kiln serve`. Building (for `--model` or no
arguments) needs the export extra; running prebuilt artifacts does not.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kiln.runtime.config import DTYPES, KV_CACHE_DTYPE_ALIASES, KV_CACHE_DTYPES, QUANTIZE_CHOICES
from kiln.runtime.lora.adapter import TARGET_MODULES as LORA_MODULES
from kiln.runtime.errors import KilnError


class ModelChoiceError(KilnError):
    """Conflicting or incomplete model arguments."""


def kv_cache_dtype(text: str) -> str:
    """A --kv-cache-dtype value by Kiln's name or another server's (vLLM's "fp8")."""
    return KV_CACHE_DTYPE_ALIASES.get(text, text)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def sequence_length(text: str) -> int:
    """A --max-model-len: whole pages of the default build's 16 tokens."""
    value = positive_int(text)
    if value % 16:
        raise argparse.ArgumentTypeError(f"expected a multiple of 16 (the build's tokens per KV page), got {value}")
    return value


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model (default: the bundled SmolLM2-135M-Instruct, built on first use)")
    group.add_argument("--artifacts", type=Path, help="a directory from `kiln build` / `kiln export-model` + compile")
    group.add_argument("--vmfb", type=Path, help="the compiled module (with --params, --config, --tokenizer: "
                       "files of a build kept apart)")
    group.add_argument("--params", type=Path, help="the model's .irpa")
    group.add_argument("--config", type=Path, help="the model's model.json")
    group.add_argument("--tokenizer", type=Path, help="tokenizer.json (default: beside the config)")
    group.add_argument("--model", type=Path, help="HF directory, .gguf or packaged model's name (gemma-3-270m) to "
                       "build (export + compile) on first use")
    group.add_argument("--dtype", choices=DTYPES, default=DTYPES[0],
                       help="with --model or the default model: the dtype to build")
    group.add_argument("--kv-cache-dtype", type=kv_cache_dtype, choices=KV_CACHE_DTYPES, default="",
                       help="with --model or the default model: the KV cache's element type (default: --dtype; "
                       "int8 or fp8_e4m3, also called fp8: about a quarter of float32's bytes, a scale per token "
                       "and head)")
    group.add_argument("--quantize", choices=QUANTIZE_CHOICES, default=QUANTIZE_CHOICES[0],
                       help="with --model or the default model, how the weight matmuls are stored (activations "
                       "and the KV cache stay float32): none: float32; bf16; int8: 8 bits with a scale per output "
                       "row; q8_0 / q4_0 / q4_1: llama.cpp's 32-weight blocks of 8 or 4 bits; gguf: a GGUF's own "
                       "blocks as stored (Q8_0, Q4_0/1, Q5_0/1, Q4_K, Q5_K, Q6_K); auto (default): a GGUF's or "
                       "BF16 checkpoint's weights as stored where Kiln reads them, float32 otherwise (the bundled "
                       "model: its Q4_1)")
    group.add_argument("--max-model-len", "--max-seq-len", dest="max_model_len", type=sequence_length, default=None,
                       metavar="TOKENS",
                       help="with --model or the default model: the longest sequence (prompt and output) the build "
                       "serves, a multiple of 16 (default: 4096)")
    group.add_argument("--tensor-parallel", "--tensor-parallel-size", type=positive_int, default=1,
                       help="with --model or the default model: shard each layer over this many devices")
    group.add_argument("--pipeline-parallel", "--pipeline-parallel-size", type=positive_int, default=1,
                       help="with --model or the default model: split the layers over this many device stages")
    group.add_argument("--cpu-kernels", choices=("auto", "on", "off"), default="auto",
                       help="with --model or the default model: one-token weight matmuls (float32, bf16, int8, "
                       "Q8_0/Q4_0/Q4_1 blocks) through Kiln's hand-written AVX-512 kernels; auto (default): where "
                       "this CPU and a C compiler allow")
    group.add_argument("--embeddings", action="store_true",
                       help="with --model or the default model: also build the functions /v1/embeddings and "
                       "/v1/score call (the final hidden states, pooled as the model's sentence-transformers files "
                       "say, else its last token's, normalised)")
    group.add_argument("--enable-lora", action="store_true",
                       help="with --model or the default model: build adapter slots, so that LoRA adapters "
                       "(--lora, /v1/load_lora_adapter) run over the model, several in one batch (implied by --lora)")
    group.add_argument("--max-loras", type=positive_int, default=4,
                       help="with --enable-lora: adapters that may be in use at once (default: %(default)s)")
    group.add_argument("--max-lora-rank", type=positive_int, default=16,
                       help="with --enable-lora: the largest adapter rank served (default: %(default)s)")
    group.add_argument("--lora-target-modules", default=",".join(LORA_MODULES), metavar="M,M",
                       help="with --enable-lora: the layers adapters may adapt (default: all of "
                       f"{','.join(LORA_MODULES)})")
    group.add_argument("--device", default="local-task", help="local-task (CPU), cuda, hip")
    group.add_argument("--parameter-memory", choices=("auto", "mapped", "private"), default="auto",
                       help="where the weights live in host memory: mapped (the file's pages, shared with every "
                       "process that maps it, e.g. data-parallel replicas on one machine), private (read into "
                       "this process's memory in huge pages: a CPU decode step a few percent faster); auto "
                       "(default): private on the CPU where the OS offers huge pages, else mapped (and with "
                       "--data-parallel)")
    group.add_argument("--device-ids", default=None,
                       help="device id(s), e.g. 0, or 0,1 for a tensor/pipeline-parallel export's devices")


def device_name(args) -> str:
    """The device URI, or a comma-separated list of them (one per id) for a multi-device export."""
    if args.device_ids:
        ids = [part.strip() for part in str(args.device_ids).split(",") if part.strip()]
        return ",".join(f"{args.device}://{device_id}" for device_id in ids)
    return args.device


def resolve_artifacts(args, log=lambda line: print(line, file=sys.stderr, flush=True)):
    """Artifacts to load, building them first when a model (or nothing) was named."""
    from kiln.runtime.contract import Artifacts, device_target

    explicit = [args.vmfb, args.params, args.config]
    if getattr(args, "max_model_len", None) and (any(explicit) or args.artifacts):
        raise ModelChoiceError("--max-model-len sets the length a model is built for (with --model or the default "
                               "model); a built model serves its build's (kiln build --max-seq-len)")
    if any(explicit):
        if not all(explicit):
            raise ModelChoiceError("--vmfb, --params and --config go together")
        if args.artifacts or args.model:
            raise ModelChoiceError("give either --vmfb/--params/--config, --artifacts or --model, not several")
        return Artifacts(args.vmfb, args.params, args.config, args.tokenizer)
    if args.artifacts:
        if args.model:
            raise ModelChoiceError("give either --artifacts or --model, not both")
        artifacts = Artifacts.in_directory(args.artifacts, device_target(args.device))
        return artifacts.with_tokenizer(args.tokenizer) if args.tokenizer else artifacts
    try:
        from dataclasses import replace

        from kiln.export.build import build, default_build_options
    except ImportError as error:
        raise ModelChoiceError(
            f"building a model needs the export extra ({error.name} is missing): "
            "pip install 'kiln[export]', or pass --artifacts DIR"
        ) from None
    if not args.device.startswith("local"):
        raise ModelChoiceError("building on first use targets the CPU: pass --artifacts for GPU builds")
    cpu_kernels = {"auto": None, "on": True, "off": False}[args.cpu_kernels]
    options = default_build_options(args.dtype, args.kv_cache_dtype, args.tensor_parallel, args.pipeline_parallel,
                                    quantize=args.quantize, cpu_kernels=cpu_kernels)
    options = replace(options, embedding_functions=args.embeddings)
    if args.max_model_len:
        # The default cache holds at least one sequence of that length.
        pages = max(options.device_block_count, -(-args.max_model_len // options.block_seq_stride))
        options = replace(options, max_seq_len=args.max_model_len, device_block_count=pages)
    if args.enable_lora or getattr(args, "lora", None):
        modules = tuple(m.strip() for m in args.lora_target_modules.split(",") if m.strip())
        options = replace(options, lora_slots=args.max_loras, lora_rank=args.max_lora_rank, lora_modules=modules)
    from kiln.models.packaged import resolve_model_path

    model = None if args.model is None else resolve_model_path(args.model)
    directory = build(model, options, ["cpu"], log=log)
    return Artifacts.in_directory(directory, "cpu")
