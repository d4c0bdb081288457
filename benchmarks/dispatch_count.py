"""How many dispatches each function of a compiled module launches per call, read from its VM code
(iree-dump-module): no device needed, so a CUDA or ROCm module is counted on any machine.

    python -m benchmarks.dispatch_count MODULE.vmfb [--json OUT]

A GPU step's time below its arithmetic is mostly launches (decode_bs1 on an H100: 911 kernels,
5.7 ms), so the count is the figure a change to the export moves first; tests hold it to the
recorded figures (docs/gpu.md). A function that replays a command buffer recorded at load (a
fixed-shape decode) launches the dispatches its initializer recorded; it is left out here, where
only what a call records itself is counted.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from benchmarks.profile_step import tool

_DISPATCH = "hal.command_buffer.dispatch"
_ABI_PREFIXES = ("prefill_", "decode_", "denoise_")


def compiled_functions(vmfb: Path) -> dict[str, str]:
    """Each function of a compiled module, by name, its VM code (a module may hold two __init
    functions: theirs are joined)."""
    dump = subprocess.run([tool("iree-dump-module"), str(vmfb)], capture_output=True, text=True, check=True).stdout
    functions, name = {}, None
    for line in dump.splitlines():
        if line.startswith("vm.func @"):
            name = line[len("vm.func @"):].split("(")[0]
            functions.setdefault(name, "")
        elif line.startswith(("vm.export", "vm.rodata", "vm.global", "vm.import")):
            name = None
        elif name is not None:
            functions[name] += line + "\n"
    return functions


def dispatch_counts(vmfb: Path) -> dict[str, int]:
    """Dispatches recorded per call by each ABI function that records its own command buffer
    (the work is in its `$async` form, which the synchronous one wraps), by function name."""
    counts = {}
    for name, code in compiled_functions(vmfb).items():
        if name.startswith(_ABI_PREFIXES) and name.endswith("$async") and "hal.command_buffer.create" in code:
            counts[name.removesuffix("$async")] = code.count(_DISPATCH)
    return dict(sorted(counts.items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("vmfb", type=Path)
    parser.add_argument("--json", type=Path, help="also write the counts here")
    args = parser.parse_args(argv)
    counts = dispatch_counts(args.vmfb)
    for name, count in counts.items():
        print(f"{name:<28} {count:>6}")
    if args.json:
        args.json.write_text(json.dumps(counts, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
