"""`kiln compile-vmfb`: drive iree-compile, with the KV cache updated in place.

Out of the box IREE imports the mutated cache argument without ownership and
copies the whole cache on every call (1-3 full copies per call; decode on a tiny
model with a 256 MiB cache went from 0.34 ms to 222 ms per token). We compile in two phases: to
the input dialect, where each exported function imports the cache with
`hal.tensor.import` and writes it back with `hal.tensor.alias`; we mark that
import `consume` (the callee owns the buffer: the KV-cache contract) with the
MLIR Python bindings; then we compile the rest. The module passes between the
phases as bytecode, which reads and writes in a fraction of its text's time.
"""

from __future__ import annotations

import subprocess
import tempfile
import time
from pathlib import Path

from kiln.runtime.contract import TARGETS
from kiln.runtime.errors import ExportError

from .placement import device_count

DEFAULT_ARCH = {"cpu": "host", "cuda": "sm_80", "rocm": "gfx942"}
# What to do when IREE has no code generation for a GPU arch. IREE 3.13 knows sm_60-sm_89 and
# sm_120 but not sm_90 (H100, H200) or sm_100; its CUDA modules hold PTX, which the driver
# compiles for the GPU at hand when the module loads, so sm_80's runs on those (checked on an H100).
UNKNOWN_ARCH_HINT = {
    "cuda": "compile for sm_80 (the default) or sm_89: their PTX runs on newer NVIDIA GPUs, the H100 and "
            "H200 included (the driver compiles it for the GPU when the module loads)",
    "rocm": "name a gfx target IREE knows, such as gfx942 (MI300) or gfx90a (MI200)",
}
DATA_TILING = "--iree-opt-data-tiling"
CPU_STACK_LIMIT = "--iree-llvmcpu-stack-allocation-limit=65536"
# Hoisting computes each expression of the weights alone (a 4-bit unpack, a widened, transposed or
# packed copy) once at load, into a global of its own for every function that traces it: SmolLM2's
# Q4_1 build then held 987 MiB after load for 107 MiB of parameters, its float32 build 2,334 for
# 513. Without it, 271 and 675 MiB; a Q4_1 prefill takes ~4% longer, a float32 one 30-70% (its
# weights are packed for the matmul on every call; benchmarks/NOTES.md "Resident memory").
NO_WEIGHT_COPIES = "--iree-opt-const-expr-hoisting=false"
# The object file of Kiln's hand-written CPU kernels (export/cpu_kernels.py), written beside the
# MLIR of an export that calls them and named in its executables.
CPU_KERNELS_OBJECT = "kiln_cpu_kernels.o"


def target_flags(target: str, arch: str | None = None, devices: int = 1) -> list[str]:
    """iree-compile flags that select a device (or `devices` of them: a multi-device export's
    __device_0.. bound to ordinals 0.. of the target's driver) and a sensible code generation."""
    if target not in TARGETS:
        raise ExportError(f"unknown target {target!r}: choose one of {', '.join(TARGETS)}")
    arch = arch or DEFAULT_ARCH[target]
    driver = {"cpu": "local", "cuda": "cuda", "rocm": "hip"}[target]
    device_flags = ([f"--iree-hal-target-device={driver}"] if devices == 1
                    else [f"--iree-hal-target-device={driver}[{ordinal}]" for ordinal in range(devices)])
    if target == "cpu":
        return [
            *device_flags,
            "--iree-hal-local-target-device-backends=llvm-cpu",
            f"--iree-llvmcpu-target-cpu={arch}",
            # Packs weights into the layouts the CPU's matmul kernels want: decode 2x
            # faster, prefill 1.5x on SmolLM2 here (benchmarks/NOTES.md).
            DATA_TILING,
            # The limit is a check after tiling, not an input to it: IREE's default (32 KiB)
            # refuses an int8 decode at batch 16 on SmolLM2's shapes (its group sums want
            # 36 KiB), and the task workers' stacks are 128 KiB. Code that fits stays the same.
            CPU_STACK_LIMIT,
            NO_WEIGHT_COPIES,
        ]
    if target == "cuda":
        return [*device_flags, f"--iree-cuda-target={arch}"]
    return [*device_flags, f"--iree-rocm-target={arch}"]


def iree_compile_tool() -> str:
    try:
        from iree.compiler.tools.binaries import find_tool
    except ImportError:
        raise ExportError("iree-base-compiler is not installed: pip install 'kiln[export]'") from None
    return find_tool("iree-compile")


def run_iree_compile(args: list[str], what: str) -> None:
    result = subprocess.run([iree_compile_tool(), *args], capture_output=True, text=True)
    if result.returncode != 0:
        detail = (result.stderr or result.stdout).strip().splitlines()
        first_error = next((line for line in detail if "error" in line), detail[0] if detail else "")
        raise ExportError(f"iree-compile failed while {what}: {first_error.strip()}")


def mark_cache_imports_consumed(module) -> int:
    """Mark the import of every argument that a function of `module` (an MLIR module at IREE's
    input level) writes back as `consume`; returns how many imports were marked. The
    written-back argument is found through the `hal.tensor.alias` that stores into it, per
    function, not by its printed name (which repeats across functions).
    """
    from iree.compiler import ir

    marked = 0
    for func in module.body.operations:
        if func.operation.name != "util.func" or not func.regions or not func.regions[0].blocks:
            continue
        for block in func.regions[0].blocks:
            aliased = set()
            for op in block.operations:
                if op.operation.name == "hal.tensor.alias":
                    for operand in op.operands:
                        if isinstance(operand.owner, ir.Block) and "hal.buffer_view" in str(operand.type):
                            aliased.add(ir.BlockArgument(operand).arg_number)
            if not aliased:
                continue
            for op in block.operations:
                if op.operation.name != "hal.tensor.import":
                    continue
                source = op.operands[0]
                if isinstance(source.owner, ir.Block) and ir.BlockArgument(source).arg_number in aliased:
                    op.attributes["consume"] = ir.UnitAttr.get()
                    marked += 1
    return marked


def pin_arguments_to_first_device(module) -> None:
    """Give every argument import and write-back of `module` that names no device an explicit
    device 0.

    A multi-device export leaves device 0's arguments unannotated (export/exporter.py's
    device_affinities says why). On a deep tensor-parallel module IREE 3.13's affinity
    analysis then fails to converge ("failed to solve for affinity analysis"); pinned, it
    compiles, at the price of copying the cache buffers on every call.
    """
    from iree.compiler import ir

    first_device = ir.Attribute.parse("#hal.device.promise<@__device_0>")
    for func in module.body.operations:
        if func.operation.name != "util.func" or not func.regions:
            continue
        for block in func.regions[0].blocks:
            for op in block.operations:
                if op.operation.name in ("hal.tensor.import", "hal.tensor.alias") and "affinity" not in op.attributes:
                    op.attributes["affinity"] = first_device


def rewrite_module(source: Path, output: Path, change):
    """Parse the module at `source` (text or bytecode), apply `change` to it, write it to
    `output` as bytecode; returns what `change` returned. Nothing of it stays in memory after."""
    from iree.compiler import ir

    with ir.Context():
        module = ir.Module.parse(source.read_bytes())
        result = change(module)
        with open(output, "wb") as written:
            module.operation.write_bytecode(written)
    return result


def compile_multi_device_fallbacks(compile_with, flags: list[str], input_path: Path, error: ExportError,
                                   log) -> None:
    """Compile a multi-device module that failed with `flags`, working around IREE 3.13's limits:
    its CPU data tiling fails on most multi-device modules ("set_encoding op encoding expects 2
    dynamic encoding dimension(s)", "failed to determine resource affinity"), which compile
    without it, with plain matmul code; and on a deep tensor-parallel module the affinity
    analysis does not converge unless device 0's arguments are pinned."""
    if DATA_TILING in flags:
        flags = [flag for flag in flags if flag != DATA_TILING]
        log(f"warning: {error}; compiling again without data tiling")
        try:
            return compile_with(flags)
        except ExportError as retry_error:
            error = retry_error
    if "affinity analysis" not in str(error):
        raise error
    log(f"warning: {error}; compiling again with device 0's arguments pinned "
        "(each call then copies the KV cache buffers)")
    rewrite_module(input_path, input_path, pin_arguments_to_first_device)
    compile_with(flags)


def check_cpu_kernels_target(mlir_path: Path, target: str, arch: str | None) -> None:
    """An export that calls the CPU kernels links an object built for the exporting machine's
    CPU: it compiles for that CPU only, with its object beside the MLIR."""
    if target != "cpu":
        raise ExportError(f"{mlir_path} calls Kiln's CPU kernels (exported with --cpu-kernels), so it compiles "
                          f"for the CPU only: export again without --cpu-kernels for {target}")
    if (arch or DEFAULT_ARCH["cpu"]) != "host":
        raise ExportError(f"{mlir_path} calls Kiln's CPU kernels, built for this machine's CPU: compile it with "
                          f"--arch host, or export again without --cpu-kernels for {arch}")
    if not (mlir_path.parent / CPU_KERNELS_OBJECT).is_file():
        raise ExportError(f"{mlir_path} calls Kiln's CPU kernels but {CPU_KERNELS_OBJECT} is not beside it: "
                          "export the model again")


def compile_vmfb(
    mlir_path: Path,
    output: Path,
    target: str = "cpu",
    arch: str | None = None,
    extra_flags: list[str] | None = None,
    log=print,
) -> Path:
    """Compile model MLIR to a VMFB for `target`; returns the VMFB path."""
    mlir_path, output = Path(mlir_path), Path(output)
    target_flags(target, arch)  # a bad target fails before the import's work
    if not mlir_path.is_file():
        raise ExportError(f"MLIR file {mlir_path} does not exist")
    output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kiln-compile-") as scratch:
        # iree-compile writes beside the output and the file is renamed into place,
        # so a failed or interrupted compile never leaves a truncated VMFB.
        scratch = Path(scratch)
        started = time.monotonic()
        run_iree_compile([str(mlir_path), "--compile-to=input", "--emit-mlir-bytecode", "-o", str(scratch / "input.mlirbc")],
                         "importing the model")
        # What the export wrote names its devices and the kernels' object as the import keeps them.
        exported = mlir_path.read_bytes().decode("latin-1")
        devices = device_count(exported)
        flags = target_flags(target, arch, devices)
        if CPU_KERNELS_OBJECT in exported:
            check_cpu_kernels_target(mlir_path, target, arch)
            flags.append(f"--iree-hal-executable-object-search-path={mlir_path.parent.resolve()}")
        del exported
        consumed = scratch / "consumed.mlirbc"
        marked = rewrite_module(scratch / "input.mlirbc", consumed, mark_cache_imports_consumed)
        if marked == 0:
            log("warning: no written-back argument found; the KV cache will be copied on every call")
        log(f"imported and marked {marked} cache argument(s) as consumed in {time.monotonic() - started:.1f}s"
            + (f"; {devices} devices" if devices > 1 else ""))

        started = time.monotonic()
        partial = output.with_name(output.name + ".partial")

        def compile_with(flags: list[str]) -> None:
            try:
                run_iree_compile(
                    [str(consumed), "--compile-from=input", *flags, *(extra_flags or []),
                     "-o", str(partial)],
                    f"compiling for {target}",
                )
            except ExportError as error:
                if target in UNKNOWN_ARCH_HINT and "missing GPU target" in str(error):
                    raise ExportError(f"this IREE compiler has no {target} code generation for --arch "
                                      f"{arch or DEFAULT_ARCH[target]}: {UNKNOWN_ARCH_HINT[target]}") from None
                raise

        try:
            try:
                compile_with(flags)
            except ExportError as error:
                if devices == 1:
                    raise
                compile_multi_device_fallbacks(compile_with, flags, consumed, error, log)
            partial.replace(output)
        finally:
            partial.unlink(missing_ok=True)
        log(f"compiled {output.name} for {target} ({output.stat().st_size / 2**20:.2f} MiB) in {time.monotonic() - started:.1f}s")
    return output
