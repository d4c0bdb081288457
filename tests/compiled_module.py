"""A compiled module's VM code, as iree-dump-module prints it, read for what tests check in it."""

from __future__ import annotations

import re

from benchmarks.dispatch_count import compiled_functions  # noqa: F401  (tests import it from here)

_RECORDED_LOAD = re.compile(r"vm\.global\.load\.ref \S+ : !hal\.command_buffer")


def replays_a_recorded_command_buffer(functions: dict[str, str], name: str) -> bool:
    """Whether a call of `name` submits a command buffer the module recorded once (a global its
    initializers filled) rather than recording one itself on every call. The work of an ABI
    function is in its `$async` form, which the synchronous one wraps."""
    body = functions[f"{name}$async"]
    recorded_here = "hal.command_buffer.create" in body
    recorded_at_load = any("hal.command_buffer.create" in code for function, code in functions.items()
                           if not function.startswith(("decode_", "prefill_", "denoise_")))
    return not recorded_here and bool(_RECORDED_LOAD.search(body)) and recorded_at_load
