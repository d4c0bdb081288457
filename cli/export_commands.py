"""`kiln export-model`, `kiln compile-vmfb` and `kiln build`: arguments and dispatch."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# By name, so that checking an error never imports the module that defines it.
USER_ERRORS = {
    "ModelLoadError", "ExportError", "ProgramLoadError", "ModelChoiceError", "InvalidRequestError", "ChatTemplateError",
}


def is_user_error(error: Exception) -> bool:
    """Errors that mean bad input, not a bug: shown as one line without a traceback."""
    names = {cls.__name__ for cls in type(error).__mro__}
    return bool(names & USER_ERRORS)


def _batch_sizes(text: str) -> list[int]:
    from kiln.export.options import ExportError, parse_batch_sizes

    try:
        return parse_batch_sizes(text)
    except ExportError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def add_export_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, help="HF model directory or .gguf file (default: bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--bs-prefill", type=_batch_sizes, default=[1, 4], help="prefill batch sizes, e.g. 1,4")
    parser.add_argument("--bs-decode", type=_batch_sizes, default=[2, 4, 8],
                        help="decode batch sizes, e.g. 2,4,8 (a batch of 2 decodes one sequence faster than 1)")
    parser.add_argument("--block-seq-stride", type=_positive_int, default=16, help="tokens per KV-cache page")
    parser.add_argument("--device-block-count", type=_positive_int, default=256, help="default KV-cache pages")
    parser.add_argument("--max-seq-len", type=_positive_int, default=0, help="longest sequence (default: model context, at most 8192)")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    parser.add_argument("--kv-cache-dtype", choices=["float32", "float16", "bfloat16"], default="",
                        help="the KV cache's element type (default: --dtype); float16 halves its bytes")
    parser.add_argument("--prefill-final-logits", action="store_true", help="prefill returns only each row's last logits")
    parser.add_argument("--top-k", type=_positive_int, default=None, help="functions return top-k values and ids, not logits")
    parser.add_argument("--logits-normalization", choices=["none", "softmax", "log_softmax"], default="none")
    parser.add_argument("--no-prefill-position", action="store_true", help="export prefill without start positions (no prefix reuse)")
    parser.add_argument(
        "--no-prefill-last", action="store_true",
        help="skip the prefill_last_bs<N> companions (prefill returning only last logits, the serving fast path)",
    )


def options_from_args(args):
    from kiln.export.options import ExportOptions

    return ExportOptions(
        prefill_batch_sizes=args.bs_prefill,
        decode_batch_sizes=args.bs_decode,
        block_seq_stride=args.block_seq_stride,
        device_block_count=args.device_block_count,
        max_seq_len=args.max_seq_len,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        prefill_final_logits=args.prefill_final_logits,
        top_k=args.top_k,
        logits_normalization=args.logits_normalization,
        has_prefill_position=not args.no_prefill_position,
        prefill_last_functions=not args.no_prefill_last,
    )


def _check_model_path(path: Path | None) -> None:
    from kiln.models.config import ModelLoadError

    if path is not None and not path.exists():
        raise ModelLoadError(f"model path {path} does not exist")


def run_export(args) -> int:
    from kiln.export.export_model import export_model
    from kiln.models.checkpoint import load_checkpoint

    _check_model_path(args.model)
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

    output = args.output or Path(args.mlir).with_name(f"model_{args.target}.vmfb")
    compile_vmfb(args.mlir, output, args.target, args.arch, args.extra_flags, log=_log)
    print(output)
    return 0


def run_build(args) -> int:
    from kiln.export.build import build

    _check_model_path(args.model)
    options = options_from_args(args)
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    directory = build(args.model, options, targets, args.output_dir, extra_flags=args.extra_flags, log=_log)
    _log("artifacts:")
    for name in ("model.json", "model.irpa", "tokenizer.json", *(f"model_{t}.vmfb" for t in targets)):
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
    compile_.add_argument("--target", required=True, choices=["cpu", "cuda", "rocm"])
    compile_.add_argument("--arch", help="host | sm_80 | gfx942 ... (default per target)")
    compile_.add_argument("-o", "--output", type=Path)
    compile_.set_defaults(run=run_compile, extra_flags=[])

    build = commands.add_parser("build", help="export and compile for a list of targets into one directory")
    add_export_options(build)
    build.add_argument("--targets", default="cpu", help="comma-separated: cpu,cuda,rocm")
    build.add_argument("--output-dir", type=Path, help="default: a cache directory keyed by model and options")
    build.set_defaults(run=run_build, extra_flags=[])

