"""llama.cpp as a benchmark peer: llama-cpp-python for offline timings, and llama.cpp's
own C++ `llama-server` (built from the source llama-cpp-python vendors) for serving.

Both come from one pinned llama-cpp-python sdist, so the Python binding, the server and
the GGUF converter are the same llama.cpp revision. Everything is built for this CPU
(GGML_NATIVE) into `<cache>/peers/`, once.

Its GGUFs are converted by llama.cpp's own convert_hf_to_gguf.py from the HF directory
of weights.py, and `check_same_weights()` shows the two agree: llama.cpp on the F32 GGUF and
transformers on the HF directory produce the same greedy tokens.

    python -m benchmarks.peers.llamacpp     # setup, the check, then offline figures for f32 and f16
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from . import transformers_peer, weights
from .common import heavy_lock, log, make_venv, others_cpu, peers_dir, run_json

VERSION = "0.3.36"  # llama-cpp-python; pins the llama.cpp revision too
VENV = "llamacpp"
# What llama.cpp's convert_hf_to_gguf.py asks for (its requirements pin transformers 4.57.6).
CONVERT_REQUIREMENTS = ["torch==2.13.0", "transformers==4.57.6", "sentencepiece==0.2.1",
                        "protobuf==4.25.9", "numpy==2.2.6"]
# llama-cpp-python builds its bundled llama.cpp with these, for this CPU.
PY_CMAKE_ARGS = "-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
SERVER_CMAKE_ARGS = [
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",  # no web UI: no npm, no download
]
TARGETS = ["llama-server", "llama-batched-bench"]
BENCH_SCRIPT = Path(__file__).with_name("llamacpp_bench.py")
# Context per server slot: 256 prompt + 128 generated tokens, plus room.
SLOT_CTX = 512
# llama.cpp's converter writes each of these from the float32 HF directory (q8_0: 32-weight
# blocks with a float16 scale each, what Kiln's int8 weights are measured against).
DTYPES = ("f32", "f16", "bf16", "q8_0")
BUNDLED = "q4_1"  # the bundled GGUF's own type
CHECK_PROMPT = "The three primary colors are"
CHECK_TOKENS = 32


def source_root() -> Path:
    """The unpacked llama-cpp-python sdist."""
    return peers_dir() / "llamacpp-src" / f"llama_cpp_python-{VERSION}"


def llama_cpp_source() -> Path:
    """llama.cpp's source tree, as vendored by the sdist."""
    return source_root() / "vendor" / "llama.cpp"


def build_dir() -> Path:
    return peers_dir() / "llamacpp-build"


def binary(name: str) -> Path:
    return build_dir() / "bin" / name


def _fetch_source() -> Path:
    """pip-download the sdist (PyPI ships only source) and unpack it, once."""
    root = source_root()
    marker = root.parent / f".unpacked-{VERSION}"
    if marker.exists():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    log(f"downloading the llama-cpp-python {VERSION} sdist")
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                    f"llama-cpp-python=={VERSION}", "-d", str(root.parent)], check=True,
                   stdout=sys.stderr)
    with tarfile.open(root.parent / f"llama_cpp_python-{VERSION}.tar.gz") as tar:
        tar.extractall(root.parent, filter="data")
    marker.write_text(VERSION)
    return root


def python() -> Path:
    """The venv's python: llama-cpp-python built from the unpacked sdist, and what the
    converter needs (gguf-py from the same llama.cpp tree)."""
    root = _fetch_source()
    reqs = [f"--find-links={root.parent}", f"llama-cpp-python=={VERSION}",
            str(llama_cpp_source() / "gguf-py"), *CONVERT_REQUIREMENTS]
    env = {"CMAKE_ARGS": PY_CMAKE_ARGS, "CMAKE_BUILD_PARALLEL_LEVEL": "2"}
    return make_venv(VENV, reqs, env=env, builds=True)


def _build_binaries() -> None:
    """CMake-build llama-server and llama-batched-bench, once per version, flags and CPU (GGML_NATIVE
    compiles for the building CPU, as Kiln's `--arch host` does)."""
    from kiln.export.build import host_cpu

    src, build = llama_cpp_source(), build_dir()
    stamp = json.dumps({"version": VERSION, "cmake": SERVER_CMAKE_ARGS, "targets": TARGETS, "host_cpu": host_cpu()})
    marker = build / ".kiln-built"
    if marker.exists() and marker.read_text() == stamp and all(binary(t).exists() for t in TARGETS):
        return
    log(f"building {', '.join(TARGETS)} from {src}")
    with heavy_lock():
        start = time.monotonic()
        subprocess.run(["cmake", "-S", str(src), "-B", str(build), "-G", "Ninja",
                        *SERVER_CMAKE_ARGS], check=True, stdout=sys.stderr)
        # -march=native is the same flag on any CPU, so ninja would keep objects built for another.
        clean = ["--clean-first"] if marker.exists() else []
        subprocess.run(["cmake", "--build", str(build), "-j2", *clean, "--target", *TARGETS],
                       check=True, stdout=sys.stderr)
    log(f"built in {time.monotonic() - start:.0f} s")
    marker.write_text(stamp)


def setup() -> Path:
    """Everything llama.cpp needs, made once; returns the venv's python."""
    py = python()
    _build_binaries()
    return py


def offline(dtype: str = "f32") -> dict:
    """Offline figures through llama-cpp-python (2 threads, greedy): prefill of 128 and
    512 tokens, decode at batch 1 and 8 (see llamacpp_bench.py for the definitions)."""
    py = setup()
    model = gguf(dtype)
    with heavy_lock(), others_cpu({}) as load:
        result = run_json(py, [str(BENCH_SCRIPT), "offline", str(model)])
        check = batched_bench(dtype)
    return {"engine": "llama.cpp", "dtype": dtype, **result, "llama_cpp_python": VERSION,
            "llama_batched_bench": check, **load}


def batched_bench(dtype: str = "f32", npp: int = 128, ntg: int = 128, npl: str = "1,8") -> dict:
    """llama.cpp's own `llama-batched-bench` (random tokens, no sampling, one run each):
    aggregate decode tokens/s for each batch size in `npl`, a cross-check of offline(), and
    the time its `npp`-token prompts took (prefill_bs<N>_ms)."""
    setup()
    largest = max(int(n) for n in npl.split(","))
    cmd = [str(binary("llama-batched-bench")), "-m", str(gguf(dtype)), "-t", "2", "-tb", "2",
           "-c", str(largest * (npp + ntg) + 64), "-b", "2048", "-ub", "512",
           "-npp", str(npp), "-ntg", str(ntg), "-npl", npl, "--output-format", "jsonl"]
    with heavy_lock():
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {**{f"decode_bs{r['pl']}_tok_s": round(r["speed_tg"], 2) for r in rows},
            **{f"prefill_bs{r['pl']}_ms": round(1000 * r["t_pp"], 2) for r in rows}}


def start_server(dtype: str, port: int, parallel: int = 16, ctx_per_slot: int = SLOT_CTX,
                 log_file: Path | None = None, model: Path | None = None) -> subprocess.Popen:
    """Start `llama-server` on 127.0.0.1:`port` with `parallel` slots (continuous batching,
    2 threads) over the bundled model's GGUF of `dtype`, or the GGUF file `model`. The caller
    waits for /health and terminates it."""
    setup()
    cmd = [str(binary("llama-server")), "-m", str(model or gguf(dtype)),
           "--host", "127.0.0.1", "--port", str(port), "-t", "2", "-tb", "2",
           "--parallel", str(parallel), "-c", str(parallel * ctx_per_slot), "--cont-batching",
           "--no-webui", "--alias", model.stem if model else "SmolLM2-135M-Instruct"]
    out = open(log_file, "ab") if log_file else subprocess.DEVNULL
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)


def gguf(dtype: str = "f32") -> Path:
    """A GGUF of `dtype` (one of DTYPES) made by llama.cpp's convert_hf_to_gguf.py from
    weights.hf_dir(), in the llama.cpp venv; converted on first use. "q4_1" is the bundled file itself
    (Q4_1 layers, a Q8_0 embedding), which every other one is converted from."""
    if dtype == BUNDLED:
        from kiln.models.default_model import default_model_path

        return default_model_path()
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, not {dtype!r}")
    target = weights.weights_dir() / f"smollm2-135m-instruct-{dtype}.gguf"
    marker = weights.weights_dir() / f".gguf-{dtype}-done"
    stamp = f"{weights.source_stamp()} llama-cpp-python={VERSION}"
    if weights.done(marker, stamp) and target.is_file():
        return target
    source = weights.hf_dir()
    py = python()
    script = llama_cpp_source() / "convert_hf_to_gguf.py"
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
    record = weights.weights_dir() / "same-weights.json"
    stamp = f"{weights.source_stamp()} llama-cpp-python={VERSION} {transformers_peer.REQUIREMENTS}"
    if record.exists():
        previous = json.loads(record.read_text())
        if previous.get("stamp") == stamp and previous.get("match"):
            return previous
    with heavy_lock():
        ref = transformers_peer.greedy(CHECK_PROMPT, CHECK_TOKENS)
        ours = run_json(python(), [str(BENCH_SCRIPT), "greedy", str(gguf("f32")),
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
    start = time.monotonic()
    setup()
    log(f"setup done in {time.monotonic() - start:.0f} s")
    with heavy_lock():  # once for the whole run: the lock is contended, not FIFO
        check_same_weights()
        for dtype in ("f32", "f16"):
            print(json.dumps(offline(dtype)), flush=True)


if __name__ == "__main__":
    main()
