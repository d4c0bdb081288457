"""The peers' copy of Kiln's bundled model, so every engine runs the very same weights.

From SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to float32 by Kiln's loader) we write,
once, into `<cache>/peers/weights/`:
  - an HF directory (safetensors, explicit lm_head, rope_theta): transformers, sharktank;
  - GGUFs in F32, F16, BF16 and Q8_0 made from that directory by llama.cpp's own converter.
`check_same_weights()` shows they agree: llama.cpp on the F32 GGUF and transformers on the
HF directory produce the same greedy tokens.

    python -m benchmarks.peers.weights      # write everything and run the check
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from .common import heavy_lock, log, peers_dir, run_json

FORMAT = "1"  # bump when what we write changes
CHECK_PROMPT = "The three primary colors are"
CHECK_TOKENS = 32
# llama.cpp's converter writes each of these from the float32 HF directory (q8_0: 32-weight
# blocks with a float16 scale each, what Kiln's int8 weights are measured against).
DTYPES = ("f32", "f16", "bf16", "q8_0")
BUNDLED = "q4_1"  # the bundled GGUF's own type


def weights_dir() -> Path:
    return peers_dir() / "weights"


def _source_stamp() -> str:
    """Identifies the source model and our format: a change rewrites everything."""
    from kiln.models.default_model import GGUF_SHA256

    return f"{GGUF_SHA256} format={FORMAT}"


def _done(marker: Path, stamp: str) -> bool:
    return marker.exists() and marker.read_text() == stamp


def hf_dir() -> Path:
    """The HF directory (untied lm_head, float32), written on first use."""
    from kiln.models.loader import load_checkpoint
    from kiln.models.hf_writer import write_hf_directory

    target = weights_dir() / "smollm2-135m-instruct-hf"
    marker = weights_dir() / ".hf-done"
    stamp = _source_stamp()
    if _done(marker, stamp) and target.is_dir():
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


def gguf(dtype: str = "f32") -> Path:
    """A GGUF of `dtype` (one of DTYPES) made by llama.cpp's convert_hf_to_gguf.py from
    hf_dir(), in the llama.cpp venv; converted on first use. "q4_1" is the bundled file itself
    (Q4_1 layers, a Q8_0 embedding), which every other one is converted from."""
    from . import llamacpp

    if dtype == BUNDLED:
        from kiln.models.default_model import default_model_path

        return default_model_path()
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, not {dtype!r}")
    target = weights_dir() / f"smollm2-135m-instruct-{dtype}.gguf"
    marker = weights_dir() / f".gguf-{dtype}-done"
    stamp = f"{_source_stamp()} llama-cpp-python={llamacpp.VERSION}"
    if _done(marker, stamp) and target.is_file():
        return target
    source = hf_dir()
    py = llamacpp.python()
    script = llamacpp.llama_cpp_source() / "convert_hf_to_gguf.py"
    partial = target.with_name(target.name + ".partial")
    log(f"converting {source.name} to {target.name}")
    with heavy_lock():
        start = time.monotonic()
        subprocess.run([str(py), str(script), str(source), "--outtype", dtype,
                        "--outfile", str(partial)], check=True, stdout=sys.stderr)
    partial.rename(target)
    marker.write_text(stamp)
    log(f"converted in {time.monotonic() - start:.0f} s")
    return target


def check_same_weights() -> dict:
    """Greedy tokens from transformers (HF dir) and llama.cpp (F32 GGUF) for one prompt;
    raises if they differ. The result is kept in weights/same-weights.json."""
    from . import llamacpp, transformers_peer

    record = weights_dir() / "same-weights.json"
    stamp = f"{_source_stamp()} llama-cpp-python={llamacpp.VERSION} {transformers_peer.REQUIREMENTS}"
    if record.exists():
        previous = json.loads(record.read_text())
        if previous.get("stamp") == stamp and previous.get("match"):
            return previous
    with heavy_lock():
        ref = transformers_peer.greedy(CHECK_PROMPT, CHECK_TOKENS)
        ours = run_json(llamacpp.python(), [str(llamacpp.BENCH_SCRIPT), "greedy", str(gguf("f32")),
                                            json.dumps(ref["prompt_ids"]), str(CHECK_TOKENS)])
    result = {"stamp": stamp, "prompt": CHECK_PROMPT, "prompt_ids": ref["prompt_ids"],
              "transformers": ref["tokens"], "llama.cpp": ours["tokens"],
              "match": ref["tokens"] == ours["tokens"]}
    record.write_text(json.dumps(result, indent=2))
    if not result["match"]:
        first = next(i for i, (a, b) in enumerate(zip(ref["tokens"], ours["tokens"])) if a != b)
        raise RuntimeError(f"llama.cpp and transformers diverge at generated token {first}: "
                           f"see {record}")
    log(f"same weights: {CHECK_TOKENS} greedy tokens agree ({record})")
    return result


def main() -> None:
    print(hf_dir())
    with heavy_lock():
        for dtype in DTYPES:
            print(gguf(dtype))
        print(json.dumps(check_same_weights()))


if __name__ == "__main__":
    main()
