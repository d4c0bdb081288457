"""Kiln's on-disk cache: where it is, and what each part of it holds.

    <cache>/models/      models fetched on first use (the bundled SmolLM2's GGUF)
    <cache>/artifacts/   exports and VMFBs built by `kiln build` / `kiln serve`, keyed by their inputs
    <cache>/peers/       the benchmark's peers, each in its own environment

<cache> is $KILN_CACHE_DIR, else $XDG_CACHE_HOME/kiln, else ~/.cache/kiln.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    if env := os.environ.get("KILN_CACHE_DIR"):
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kiln"


def models_dir() -> Path:
    return cache_dir() / "models"


def artifacts_dir() -> Path:
    return cache_dir() / "artifacts"


def peers_dir() -> Path:
    return cache_dir() / "peers"
