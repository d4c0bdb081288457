"""`kiln export-model`, `kiln compile-vmfb` and `kiln build`: arguments and dispatch."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from kiln.export.options import ATTENTION_FORMS, LOGITS_NORMALIZATIONS, ExportOptions
from kiln.runtime.config import DTYPES, KV_CACHE_DTYPES, QUANTIZE_CHOICES
from kiln.runtime.contract import CONFIG_FILE, PARAMETERS_FILE, TARGETS, TOKENIZER_FILE, vmfb_file
from kiln.runtime.errors import ExportError

from .model_args import kv_cache_dtype, positive_int


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _batch_sizes(text: str) -> list[int]:
    from kiln.export.options import parse_batch_sizes

    try:
        return parse_batch_sizes(text)
    except ExportError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _decode_buckets(text: str) -> tuple[int, ...]:
    from kiln.export.options import parse_decode_buckets

    try:
        return parse_decode_buckets(text)
    except ExportError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _modules(text: str) -> tuple[str, ...]:
    return tuple(m.strip() for m in text.split(",") if m.strip())


def add_export_options(parser: argparse.ArgumentParser) -> None:
    defaults = ExportOptions()
    sizes = ",".join
    parser.add_argument("--model", type=Path, help="HF model directory or .gguf file (default: bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--bs-prefill", type=_batch_sizes, default=defaults.prefill_batch_sizes,
                        help=f"prefill batch sizes (default: {sizes(map(str, defaults.prefill_batch_sizes))})")
    parser.add_argument("--bs-decode", type=_batch_sizes, default=defaults.decode_batch_sizes,
                        help=f"decode batch sizes (default: {sizes(map(str, defaults.decode_batch_sizes))}; "
                        "a batch of 2 decodes one sequence faster than 1)")
    parser.add_argument("--bs-denoise", type=_batch_sizes, default=defaults.denoise_batch_sizes,
                        help=f"denoise batch sizes of a diffusion LM (default: {sizes(map(str, defaults.denoise_batch_sizes))})")
    parser.add_argument("--denoise-top", action="store_true",
                        help="a diffusion LM also exports denoise_top_bs<N> (per-position greedy summaries instead "
                        "of [N, T, V] logits), which greedy batches then call; far slower on the CPU today")
    parser.add_argument("--block-seq-stride", type=positive_int, default=defaults.block_seq_stride,
                        help="tokens per KV-cache page (default: %(default)s)")
    parser.add_argument("--device-block-count", type=positive_int, default=defaults.device_block_count,
                        help="default KV-cache pages (default: %(default)s)")
    parser.add_argument("--decode-buckets", type=_decode_buckets, default=defaults.decode_buckets, metavar="T,T|none",
                        help="context lengths that also get a decode with every shape fixed (for a cache of exactly "
                        "--device-block-count pages), whose command buffer is recorded once rather than on every "
                        "call; the server calls the smallest that fits (default: max-seq-len where decode attention "
                        "reads the pages in place, else none)")
    parser.add_argument("--max-seq-len", type=positive_int, default=defaults.max_seq_len,
                        help="longest sequence (default: model context, at most 8192)")
    parser.add_argument("--dtype", choices=DTYPES, default=defaults.dtype)
    parser.add_argument("--kv-cache-dtype", type=kv_cache_dtype, choices=KV_CACHE_DTYPES,
                        default=defaults.kv_cache_dtype,
                        help="the KV cache's element type (default: --dtype); float16 halves its bytes, int8 or "
                        "fp8_e4m3 (also called fp8; a scale per token and head) store about a quarter of float32's")
    parser.add_argument("--quantize", choices=QUANTIZE_CHOICES, default=defaults.quantize,
                        help="store the weight matmuls' weights as bf16, int8 with a scale per output row, or "
                        "int8 in Q8_0's blocks of 32 (activations and KV cache stay float32; needs --dtype "
                        "float32); auto (default): a Q8_0 or BF16 GGUF's weights as stored, else --dtype")
    parser.add_argument("--prefill-final-logits", action="store_true", help="prefill returns only each row's last logits")
    parser.add_argument("--top-k", type=positive_int, default=None, help="functions return top-k values and ids, not logits")
    parser.add_argument("--logits-normalization", choices=LOGITS_NORMALIZATIONS, default=defaults.logits_normalization)
    parser.add_argument("--no-prefill-position", action="store_true", help="export prefill without start positions (no prefix reuse)")
    parser.add_argument("--tensor-parallel", type=positive_int, default=defaults.tensor_parallel,
                        help="shard each layer's heads and MLP columns over this many devices")
    parser.add_argument("--pipeline-parallel", type=positive_int, default=defaults.pipeline_parallel,
                        help="split the layers into this many stages, one device (or tensor-parallel group) each")
    parser.add_argument(
        "--no-prefill-last", action="store_true",
        help="skip the prefill_last_bs<N> companions (prefill returning only last logits, the serving fast path)",
    )
    parser.add_argument(
        "--embeddings", action="store_true",
        help="also export embed_bs<N> beside each prefill size (the final hidden states), which /v1/embeddings "
             "and /v1/score pool as the model's sentence-transformers files say (default: last token, normalised)",
    )
    parser.add_argument("--max-loras", type=int, default=defaults.lora_slots, metavar="N",
                        help="LoRA adapter slots: every function also takes each row's slot and the slots' stacked "
                        "weights, so up to N adapters run over the model at once (default: 0, none)")
    parser.add_argument("--max-lora-rank", type=positive_int, default=defaults.lora_rank,
                        help="with --max-loras: the largest adapter rank (default: %(default)s)")
    parser.add_argument("--lora-target-modules", type=_modules, default=defaults.lora_modules, metavar="M,M",
                        help="with --max-loras: the layers adapters may adapt (default: all of "
                        f"{','.join(defaults.lora_modules)})")
    parser.add_argument(
        "--attention", choices=ATTENTION_FORMS, default=defaults.attention,
        help="attention over the cached pages as matmuls around a blocked softmax (fastest on the CPU) or as one "
             "fused op (IREE's flash-attention kernel on GPUs); default: fused when every target is a GPU",
    )
    parser.add_argument(
        "--sampling-functions", action=argparse.BooleanOptionalAction, default=defaults.sampling_functions,
        help="also export sample_bs<N>: a step's tokens chosen on the device (greedy, temperature, top-k, top-p, "
             "min-p), so a step sends back token ids, not the vocabulary's logits; default: on when every target "
             "is a GPU",
    )
    parser.add_argument(
        "--cpu-kernels", action="store_true",
        help="run one-token weight matmuls (float32, bf16, Q8_0/Q4_0/Q4_1 blocks) through Kiln's hand-written "
             "AVX-512 kernels (built with the system's C compiler); the export then compiles for this machine's CPU only",
    )


# Options whose flag names the ExportOptions field as it is (--block-seq-stride: block_seq_stride).
_SAME_NAMED = ("block_seq_stride", "device_block_count", "max_seq_len", "dtype", "kv_cache_dtype", "quantize",
               "prefill_final_logits", "top_k", "logits_normalization", "tensor_parallel", "pipeline_parallel",
               "cpu_kernels", "decode_buckets", "attention", "sampling_functions")


def options_from_args(args) -> ExportOptions:
    return ExportOptions(
        prefill_batch_sizes=tuple(args.bs_prefill),
        decode_batch_sizes=tuple(args.bs_decode),
        denoise_batch_sizes=tuple(args.bs_denoise),
        denoise_top_functions=args.denoise_top,
        has_prefill_position=not args.no_prefill_position,
        prefill_last_functions=not args.no_prefill_last,
        embedding_functions=args.embeddings,
        lora_slots=args.max_loras,
        lora_rank=args.max_lora_rank,
        lora_modules=tuple(args.lora_target_modules),
        **{name: getattr(args, name) for name in _SAME_NAMED},
    )


def _model_path(path: Path | None) -> Path | None:
    """The model file or directory named (a packaged model's name resolved); it must exist."""
    from kiln.models.packaged import resolve_model_path
    from kiln.runtime.errors import ModelLoadError

    if path is None:
        return None
    path = resolve_model_path(path)
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist")
    return path


def run_export(args) -> int:
    from kiln.export.export_model import export_model
    from kiln.models.loader import load_checkpoint

    args.model = _model_path(args.model)
    options = options_from_args(args)
    started = time.monotonic()
    _log("loading the model" + (f" from {args.model}" if args.model else " (bundled SmolLM2-135M-Instruct)"))
    checkpoint = load_checkpoint(args.model)
    _log(f"loaded {checkpoint.config.name or 'model'} in {time.monotonic() - started:.1f}s")
    exported = export_model(checkpoint, options, args.output_dir, log=_log)
    _log(f"done in {time.monotonic() - started:.1f}s")
    print(exported.directory)
    return 0


def run_compile(args) -> int:
    from kiln.export.compile import compile_vmfb

    output = args.output or Path(args.mlir).with_name(vmfb_file(args.target))
    compile_vmfb(args.mlir, output, args.target, args.arch, args.extra_flags, log=_log)
    print(output)
    return 0


def run_build(args) -> int:
    from kiln.export.build import build

    args.model = _model_path(args.model)
    options = options_from_args(args)
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    directory = build(args.model, options, targets, args.output_dir, extra_flags=args.extra_flags, log=_log)
    _log("artifacts:")
    for name in (CONFIG_FILE, PARAMETERS_FILE, TOKENIZER_FILE, *(vmfb_file(t) for t in targets)):
        _log(f"  {directory / name}")
    print(directory)
    return 0


def add_commands(commands) -> None:
    export = commands.add_parser("export-model", help="trace a model into MLIR + parameters + config")
    add_export_options(export)
    export.add_argument("--output-dir", type=Path, required=True)
    export.set_defaults(run=run_export)

    compile_ = commands.add_parser(
        "compile-vmfb",
        help="compile model MLIR to a VMFB",
        usage="kiln compile-vmfb MODEL.mlir --target cpu|cuda|rocm [--arch ARCH] [-o OUT.vmfb] [-- extra iree-compile flags]",
    )
    compile_.add_argument("mlir", type=Path)
    compile_.add_argument("--target", required=True, choices=TARGETS)
    compile_.add_argument("--arch", help="host | sm_80 | gfx942 ... (default per target)")
    compile_.add_argument("-o", "--output", type=Path)
    compile_.set_defaults(run=run_compile, extra_flags=[])

    build = commands.add_parser("build", help="export and compile for a list of targets into one directory")
    add_export_options(build)
    build.add_argument("--targets", default="cpu", help="comma-separated: cpu,cuda,rocm")
    build.add_argument("--output-dir", type=Path, help="default: a cache directory keyed by model and options")
    build.set_defaults(run=run_build, extra_flags=[])

