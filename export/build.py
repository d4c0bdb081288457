"""`kiln build`: export once, compile for each target, into one directory.

Without an output directory the artifacts go to Kiln's cache, keyed by the model,
the options and the package versions, so a second run reuses them.
"""

from __future__ import annotations

import gc
import hashlib
import json
from dataclasses import asdict, replace
from pathlib import Path

from kiln.models.loader import load_checkpoint
from kiln.models.cache import artifacts_dir

from kiln.runtime.contract import CONFIG_FILE, MLIR_FILE, vmfb_file

from .compile import compile_vmfb, target_flags
from .export_model import export_model
from .options import ExportOptions


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for package in ("kiln", "torch", "iree-turbine", "iree-base-compiler"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = ""
    found["kiln-export-code"] = export_code_digest()
    return found


def export_code_digest() -> str:
    """A digest of the code that shapes an export, so edited code never reuses stale artifacts."""
    import kiln.export
    import kiln.models

    digest = hashlib.sha256()
    for package in (kiln.models, kiln.export):
        for path in sorted(p for pattern in ("*.py", "*.c", "*.h") for p in Path(package.__path__[0]).glob(pattern)):
            digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def host_cpu() -> str:
    """The CPU that `--arch host` compiles for (and the CPU kernels are built for), as a digest
    of its model name and feature flags: a cache directory shared by machines with other CPUs
    must not hand one CPU's code to another, where it would run slowly or not at all."""
    import platform

    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    described = sorted({line for line in lines if line.split(":")[0].strip() in ("model name", "flags", "Features")})
    identity = "\n".join([platform.machine(), platform.processor(), *described])
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


def artifacts_key(model_path: Path | None, options: ExportOptions, extra: dict | None = None) -> str:
    """A short stable name for these inputs: the model file's identity, options, versions."""
    if model_path is None:
        identity = "default:SmolLM2-135M-Instruct.Q4_1"
    else:
        model_path = Path(model_path).resolve()
        stat_source = model_path / "config.json" if model_path.is_dir() else model_path
        stat = stat_source.stat() if stat_source.exists() else None
        identity = f"{model_path}:{stat.st_size if stat else 0}:{stat.st_mtime_ns if stat else 0}"
    blob = json.dumps([identity, asdict(options), _versions(), extra or {}], sort_keys=True)
    stem = "smollm2-135m-instruct" if model_path is None else Path(model_path).stem.lower()
    return f"{stem}-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"


def default_build_options(dtype: str = "float32", kv_cache_dtype: str = "", tensor_parallel: int = 1,
                          pipeline_parallel: int = 1, quantize: str = "auto", cpu_kernels: bool | None = None) -> ExportOptions:
    """What `kiln serve` / `kiln generate` build on first use (and what the tests build):
    one definition, so both land on the same cache key and the model is built once.
    `cpu_kernels` None: Kiln's hand-written CPU kernels where this machine builds them and the
    model runs on one device."""
    if cpu_kernels is None:
        from .cpu_kernels import support_problem

        cpu_kernels = tensor_parallel * pipeline_parallel == 1 and support_problem() is None
    # 1024 pages of 16 tokens: 16 sequences of 1024 tokens decode at once without
    # preemption (256 pages held ~10 of the serving benchmark's 384-token requests).
    return ExportOptions(decode_batch_sizes=(1, 2, 4, 8, 16), dtype=dtype, max_seq_len=4096, device_block_count=1024,
                         kv_cache_dtype=kv_cache_dtype, tensor_parallel=tensor_parallel,
                         pipeline_parallel=pipeline_parallel, quantize=quantize, cpu_kernels=cpu_kernels)


def for_targets(options: ExportOptions, targets: list[str]) -> ExportOptions:
    """The options with what they leave open chosen for the targets. Where every target is a
    GPU: attention as one fused op (IREE's flash-attention kernel there; its CPU code is several
    times slower than matmuls) and sampling functions (a GPU step then sends back token ids, not
    the vocabulary's logits; on the CPU numpy reads them where they lie)."""
    gpus_only = bool(targets) and "cpu" not in targets
    if not options.attention:
        options = replace(options, attention="fused" if gpus_only else "matmuls")
    if options.sampling_functions is None:
        raw_logits = options.top_k is None and options.logits_normalization == "none"
        options = replace(options, sampling_functions=gpus_only and raw_logits and options.layout.device_count == 1)
    return options


def _export(model_path: Path | None, options: ExportOptions, output_dir: Path, log) -> None:
    """Load and export in a frame of their own, and collect what they leave in reference cycles
    (traced graphs), so that nothing of the model stays in memory while iree-compile runs."""
    log("loading the model" + (f" from {model_path}" if model_path else " (bundled SmolLM2-135M-Instruct)"))
    export_model(load_checkpoint(model_path), options, output_dir, log=log)
    gc.collect()


def build(
    model_path: Path | None,
    options: ExportOptions,
    targets: list[str],
    output_dir: Path | None = None,
    arch: dict[str, str] | None = None,
    extra_flags: list[str] | None = None,
    log=print,
) -> Path:
    """Export + compile for every target; skip what is already built. Returns the directory."""
    for target in targets:
        target_flags(target)  # reject unknown targets before the slow part
    options = for_targets(options, targets)
    arch = arch or {}
    reuse = output_dir is None  # only a keyed cache directory is known to match these inputs
    if output_dir is None:
        host = host_cpu() if arch.get("cpu", "host") == "host" else ""
        key = artifacts_key(model_path, options, {"arch": arch, "flags": extra_flags or [], "host_cpu": host})
        output_dir = artifacts_dir() / key
    output_dir = Path(output_dir)
    if reuse and (output_dir / CONFIG_FILE).exists():
        log(f"export: {output_dir} already holds an export, reusing it")
    else:
        _export(model_path, options, output_dir, log)
    for target in targets:
        vmfb = output_dir / vmfb_file(target)
        if reuse and vmfb.exists() and vmfb.stat().st_mtime >= (output_dir / MLIR_FILE).stat().st_mtime:
            log(f"compile: {vmfb.name} is up to date")
            continue
        compile_vmfb(output_dir / MLIR_FILE, vmfb, target, arch.get(target), extra_flags, log=log)
    return output_dir
