"""Kiln's runtime: a compiled model served with iree.runtime, numpy and tokenizers (no torch).

    from kiln.runtime import LLM, SamplingParams

The names below load on first use, so importing one light module of the package
(`kiln.runtime.errors`, `kiln.runtime.contract`) does not load iree.runtime.
"""

from importlib import import_module

_EXPORTS = {
    "LLM": "offline", "GenerationResult": "offline",
    "Artifacts": "contract", "Program": "program",
    "Completion": "request", "Event": "request", "TokenLogprob": "request",
    "SamplingParams": "sampling",
    "GenerateService": "service", "ServiceState": "service", "ServiceConfig": "service_config",
    "SpeculativeConfig": "service_config",
    "KilnError": "errors", "InvalidRequestError": "errors", "NotReadyError": "errors",
    "QueueFullError": "errors", "ModelLoadError": "errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f".{module}", __name__), name)
