"""The peers' copy of Kiln's bundled model, so every engine runs the very same weights.

From SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to float32 by Kiln's loader) we write,
once, into `<cache>/peers/weights/`, an HF directory (safetensors, explicit lm_head,
rope_theta) for transformers and sharktank. llama.cpp's GGUFs are made from it by
llama.cpp's own converter (llamacpp.gguf), which also checks that the two agree.

    python -m benchmarks.peers.weights      # write the HF directory
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from .common import log, peers_dir

FORMAT = "1"  # bump when what we write changes


def weights_dir() -> Path:
    return peers_dir() / "weights"


def source_stamp() -> str:
    """Identifies the source model and our format: a change rewrites everything."""
    from kiln.models.default_model import GGUF_SHA256

    return f"{GGUF_SHA256} format={FORMAT}"


def done(marker: Path, stamp: str) -> bool:
    return marker.exists() and marker.read_text() == stamp


def hf_dir() -> Path:
    """The HF directory (untied lm_head, float32), written on first use."""
    from kiln.models.loader import load_checkpoint
    from kiln.models.hf_writer import write_hf_directory

    target = weights_dir() / "smollm2-135m-instruct-hf"
    marker = weights_dir() / ".hf-done"
    stamp = source_stamp()
    if done(marker, stamp) and target.is_dir():
        return target
    log(f"writing the HF directory {target}")
    start = time.monotonic()
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    write_hf_directory(load_checkpoint(None), partial, untie_lm_head=True)
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    marker.write_text(stamp)
    log(f"HF directory written in {time.monotonic() - start:.0f} s")
    return target


def main() -> None:
    print(hf_dir())


if __name__ == "__main__":
    main()
