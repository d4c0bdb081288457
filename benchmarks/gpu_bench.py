"""Kiln on a CUDA GPU: parity with its CPU build and offline figures against eager PyTorch
(Hugging Face transformers) on the same GPU, for the bundled model's shapes.

    python -m benchmarks.gpu_bench prepare -o DIR [--decode-buckets 256]  # here: build, CPU references
    python -m benchmarks.gpu_bench run DIR --output F                     # on the GPU machine

A GPU machine may hold neither the weights nor a way to fetch them, and the weights are
hundreds of MB while the compiled modules are a few. So `prepare` packs, per precision, the
CUDA module, the model's config and tokenizer and a manifest of its parameters (name, shape,
element type), and `run` writes the parameters from the manifest: values from a counter hash
of each name, the same bits on any machine. The work of a step does not depend on the values,
so the timings are the real model's; and `prepare` runs the CPU module on the same values, so
`run` checks the GPU's greedy tokens against the CPU's. The PyTorch peer is built from the
model's HF config with random weights of the same shapes and precision.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
import zlib
from pathlib import Path

import numpy as np

from benchmarks.report import fixed_decode_table

# name -> (Kiln's export dtype, the PyTorch peer's dtype)
PRECISIONS = {"f32": ("float32", "float32"), "bf16": ("bfloat16", "bfloat16")}
# With `prepare --decode-buckets`, each fixed-shape decode against its decode_bs<N> in this many
# alternating pairs (fixed_decode_bench's comparison) on the GPU.
FIXED_DECODE_PAIRS = 200
PARITY_PROMPTS = 4
PARITY_PROMPT_TOKENS = 24
PARITY_TOKENS = 16
_PARAMETER = re.compile(r'#flow\.parameter\.named<"[^"]+"::"([^"]+)"> : tensor<([^>]*)>')
_ELEMENT = {"f32": np.float32, "bf16": np.uint16, "f16": np.float16}
# Beside the module and its parameters, what the runtime reads: the config, Kiln's sidecar, the tokenizer.
MODEL_FILES = ("model.json", "model.kiln.json", "tokenizer.json", "tokenizer_config.json")


def parameter_manifest(mlir: str) -> list[dict]:
    """The parameters a module reads, in the order it declares them: name, shape, element type."""
    manifest = []
    for name, tensor in _PARAMETER.findall(mlir):
        *dims, element = tensor.split("x")
        if element not in _ELEMENT:
            raise SystemExit(f"{name}: synthetic values for {element} parameters are not written")
        manifest.append({"name": name, "shape": [int(d) for d in dims], "element": element})
    return manifest


def synthetic_values(name: str, shape: list[int], element: str) -> np.ndarray:
    """Deterministic values for one parameter: a 64-bit mix of (element index, crc32 of the name)
    mapped to [-1, 1), scaled like a trained model's (norm weights near 1, the rest small). The
    mix is integer arithmetic and the float steps are single IEEE operations on float32, so every
    machine and numpy version gives the same bits."""
    count = int(np.prod(shape, dtype=np.int64))
    x = np.arange(count, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(zlib.crc32(name.encode()))
    x ^= x >> np.uint64(31)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(29)
    unit = (x >> np.uint64(40)).astype(np.float32) * np.float32(2.0 ** -23) - np.float32(1.0)
    values = 1.0 + 0.1 * unit if "norm" in name else 0.05 * unit
    values = values.astype(np.float32).reshape(shape)
    if element == "bf16":  # truncated to the upper 16 bits, as stored
        return (values.view(np.uint32) >> np.uint32(16)).astype(np.uint16)
    return values.astype(_ELEMENT[element])


def write_parameters(manifest: list[dict], path: Path) -> None:
    from iree import runtime as ireert

    index = ireert.ParameterIndex()
    for entry in manifest:
        index.add_buffer(entry["name"], synthetic_values(entry["name"], entry["shape"], entry["element"]).tobytes())
    index.create_archive_file(str(path))


def parity_prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(100, min(vocab, 32000), PARITY_PROMPT_TOKENS).tolist() for _ in range(PARITY_PROMPTS)]


def greedy_tokens(artifacts, device: str) -> list[list[int]]:
    from kiln.runtime import LLM, SamplingParams

    with LLM(artifacts, device=device, prefix_sharing="none") as llm:
        prompts = parity_prompts(llm.service.vocab_size)
        params = SamplingParams(max_tokens=PARITY_TOKENS, temperature=0, ignore_eos=True)
        return [r.completions[0].token_ids for r in llm.generate(prompts, params)]


def _artifacts(directory: Path, target: str):
    from kiln.runtime.contract import Artifacts

    return Artifacts.in_directory(directory, target)


def prepare(out: Path, decode_buckets: tuple[int, ...] = ()) -> None:
    """Build each precision for the CPU and CUDA, pack what the GPU run needs, and
    record the CPU module's greedy tokens on the synthetic parameters.

    The build is `kiln serve`'s for a GPU (its decodes take dynamic shapes); `decode_buckets`
    adds fixed-shape decodes of those context lengths, which every figure of `run` then goes
    through where a row's context fits (and `run` compares them with decode_bs<N>)."""
    from benchmarks.kiln_offline import build_in_child
    from benchmarks.peers import weights

    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(weights.hf_dir() / "config.json", out / "hf_config.json")
    for name, (dtype, _) in PRECISIONS.items():
        # CUDA at the default arch (sm_80): its PTX, which the driver compiles for the GPU at hand.
        options = f"default_build_options({dtype!r}, quantize='none', cpu_kernels=False)"
        if decode_buckets:
            options = f"replace({options}, decode_buckets={decode_buckets!r})"
        built = build_in_child(options, targets=("cpu", "cuda"))
        package = out / name
        package.mkdir(exist_ok=True)
        # The CPU module too: `run --device local-task` tries the whole run here first.
        for file in ("model_cuda.vmfb", "model_cpu.vmfb", *MODEL_FILES):
            shutil.copy(built / file, package / file)
        manifest = parameter_manifest((built / "model.mlir").read_text())
        (package / "manifest.json").write_text(json.dumps(manifest))
        with tempfile.TemporaryDirectory() as scratch:
            local = Path(scratch)
            for file in ("model_cpu.vmfb", *MODEL_FILES):
                (local / file).symlink_to((built / file).resolve())
            write_parameters(manifest, local / "model.irpa")
            tokens = greedy_tokens(_artifacts(local, "cpu"), "local-task")
        (package / "cpu_tokens.json").write_text(json.dumps(tokens))
        print(f"{name}: packed {package} ({len(manifest)} parameters)", file=sys.stderr)


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run(packed: Path, device: str, output: Path | None) -> int:
    from benchmarks.kiln_offline import measure
    from kiln.runtime.contract import device_target

    target = device_target(device)
    torch_device = "cpu" if target == "cpu" else "cuda"  # ROCm's PyTorch names its GPUs cuda too
    results = {"device": device, "precisions": {}}
    failed = False
    for name, (_, torch_dtype) in PRECISIONS.items():
        package = packed / name
        manifest = json.loads((package / "manifest.json").read_text())
        write_parameters(manifest, package / "model.irpa")
        expected = json.loads((package / "cpu_tokens.json").read_text())
        got = greedy_tokens(_artifacts(package, target), device)
        agree = [_first_difference(e, g) for e, g in zip(expected, got)]
        print(f"{name}: greedy tokens equal to the CPU build's for {agree} of {PARITY_TOKENS}", file=sys.stderr)
        kiln = measure(package, device=device)
        fixed = fixed_decode_pairs(package, device)
        if fixed:
            print(f"{name}: fixed-shape decode against decode_bs<N> {fixed}", file=sys.stderr)
        with tempfile.TemporaryDirectory() as hf:
            shutil.copy(packed / "hf_config.json", Path(hf) / "config.json")
            peer = subprocess.run(
                [sys.executable, str(Path(__file__).with_name("peers") / "transformers_bench.py"), "offline", hf,
                 "--device", torch_device, "--dtype", torch_dtype, "--random-weights"],
                check=True, stdout=subprocess.PIPE, text=True)
        torch_figures = json.loads(peer.stdout.strip().splitlines()[-1])
        results["precisions"][name] = {"kiln": kiln, "torch": torch_figures, "tokens_equal_to_cpu": agree,
                                       "tokens_compared": PARITY_TOKENS, **({"fixed_decode": fixed} if fixed else {})}
        # float32 on both sides: greedy tokens match the CPU build's; bf16 rounds differently per
        # reduction order, so its agreement is reported, not required.
        failed |= name == "f32" and min(agree) < PARITY_TOKENS
        print(f"{name}: kiln {kiln}; torch {torch_figures}", file=sys.stderr)
        if output:  # what is measured so far survives a later failure
            output.write_text(json.dumps(results, indent=2) + "\n")
    served = serve_check(packed / "f32", device)
    results["serve"] = served
    print(f"kiln serve on {device}: {served}", file=sys.stderr)
    failed |= not (served["completion_status"] == 200 and served["completion_tokens"] == 8
                   and served["stream_status"] == 200 and served["stream_done"])
    print(report(results))
    if output:
        output.write_text(json.dumps(results, indent=2) + "\n")
    return 1 if failed else 0


def fixed_decode_pairs(package: Path, device: str) -> dict | None:
    """Each batch's fixed-shape decode against its decode_bs<N> on `device`, in alternating pairs
    over a cache of the export's page count (fixed_decode_bench's comparison); None for a
    build without fixed-shape decodes."""
    from benchmarks import fixed_decode_bench, precision_bench
    from kiln.runtime.config import load_model_config
    from kiln.runtime.contract import device_target

    params, kiln = load_model_config(package / "model.json")
    if not (kiln and kiln.decode_buckets):
        return None
    calls = precision_bench.Calls(package, device, pages=params.paged_kv_cache.device_block_count)
    exact = device_target(device) == "cpu"
    return {f"bs{batch}": fixed_decode_bench.compare(calls, batch, FIXED_DECODE_PAIRS, exact)
            for batch in precision_bench.DECODE_BATCHES}


def _post(url: str, body: dict) -> tuple[int, bytes]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return response.status, response.read()


def serve_check(package: Path, device: str, port: int = 8431) -> dict:
    """`kiln serve` on the GPU module: a completion and a streamed chat answer over HTTP."""
    command = [sys.executable, "-m", "kiln.cli.main", "serve", "--artifacts", str(package), "--device", device,
               "--host", "127.0.0.1", "--port", str(port)]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if server.poll() is not None:
                raise SystemExit(f"kiln serve exited: {server.stderr.read()[-2000:]}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("kiln serve did not become healthy in 180 s")
            time.sleep(1)
        status, body = _post(base + "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 8,
                                                       "temperature": 0, "ignore_eos": True})
        completion = json.loads(body)
        status_stream, stream = _post(base + "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, "stream": True})
        chunks = [line for line in stream.decode().splitlines() if line.startswith("data: {")]
        return {"completion_status": status, "completion_tokens": completion["usage"]["completion_tokens"],
                "stream_status": status_stream, "stream_chunks": len(chunks),
                "stream_done": stream.decode().rstrip().endswith("data: [DONE]")}
    finally:
        server.terminate()
        server.wait(timeout=30)


def report(results: dict) -> str:
    rows = ["| precision | engine | decode bs1 tok/s | decode bs8 tok/s | prefill 128 ms | prefill 512 ms |",
            "|---|---|---:|---:|---:|---:|"]
    for name, entry in results["precisions"].items():
        for engine in ("kiln", "torch"):
            f = entry[engine]
            rows.append(f"| {name} | {engine} | {f['decode_bs1_tok_s']:.1f} | {f['decode_bs8_tok_s']:.1f} | "
                        f"{f['prefill_128_ms']:.2f} | {f['prefill_512_ms']:.2f} |")
        k, t = entry["kiln"], entry["torch"]
        rows.append(f"| {name} | kiln / torch | {k['decode_bs1_tok_s'] / t['decode_bs1_tok_s']:.2f}x | "
                    f"{k['decode_bs8_tok_s'] / t['decode_bs8_tok_s']:.2f}x | "
                    f"{t['prefill_128_ms'] / k['prefill_128_ms']:.2f}x | {t['prefill_512_ms'] / k['prefill_512_ms']:.2f}x |")
    fixed = {name: entry["fixed_decode"] for name, entry in results["precisions"].items() if "fixed_decode" in entry}
    if fixed:
        rows += ["", fixed_decode_table({"results": fixed})]
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("-o", "--output", type=Path, required=True)
    p.add_argument("--decode-buckets", default="",
                   help="fixed-shape decodes of these context lengths (comma-separated multiples of 16), "
                   "compared with decode_bs<N> on the GPU")
    r = sub.add_parser("run")
    r.add_argument("packed", type=Path)
    r.add_argument("--device", default="cuda")
    r.add_argument("--output", type=Path)
    args = parser.parse_args()
    if args.command == "prepare":
        try:
            buckets = tuple(int(t) for t in args.decode_buckets.split(",") if t)
        except ValueError:
            parser.error(f"--decode-buckets takes context lengths such as 256,1024, not {args.decode_buckets!r}")
        prepare(args.output, buckets)
        return 0
    return run(args.packed, args.device, args.output)


if __name__ == "__main__":
    sys.exit(main())
