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
import contextlib
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

from benchmarks.dispatch_count import dispatch_counts
from benchmarks.report import fixed_decode_table

# name -> (Kiln's export dtype, the PyTorch peer's dtype)
PRECISIONS = {"f32": ("float32", "float32"), "bf16": ("bfloat16", "bfloat16")}
# With `prepare --decode-buckets`, each fixed-shape decode against its decode_bs<N> in this many
# alternating pairs (fixed_decode_bench's comparison) on the GPU.
FIXED_DECODE_PAIRS = 200
PARITY_PROMPTS = 4
PARITY_PROMPT_TOKENS = 24
PARITY_TOKENS = 16
# Decode through torch.compile's CUDA graphs (transformers' fastest one-GPU path) in bf16, its
# fastest precision: compiling each shape takes minutes of the GPU's time.
COMPILED_PEER_PRECISIONS = ("bf16",)
# The serving figures: benchmarks.loadgen against `kiln serve` on the bf16 module.
SERVING_PRECISION = "bf16"
SERVING_CONCURRENCY = (1, 16, 64)
SERVING_INPUT, SERVING_OUTPUT = 256, 128
SERVING_KEYS = ("completed", "failed", "duration_s", "output_throughput", "mean_ttft_ms", "p50_ttft_ms",
                "p99_ttft_ms", "mean_itl_ms", "p50_itl_ms", "p99_itl_ms")
_PARAMETER = re.compile(r'#flow\.parameter\.named<"[^"]+"::"([^"]+)"> : tensor<([^>]*)>')
_ELEMENT = {"f32": np.float32, "bf16": np.uint16, "f16": np.float16}
# `prepare --graphs`: these precisions also built to run their decode steps as CUDA graphs, with
# the decodes the figures call (batch 1 and 8).
GRAPH_PRECISIONS = ("bf16",)
GRAPH_BUCKETS = (256,)
GRAPH_COMPILE_FLAGS = ("--iree-stream-partitioning-favor=debug",)
GRAPH_DEVICE_FLAGS = ("--cuda_use_streams=false",)
# Each precision is also packed with attention as matmuls (the CPU's form), measured beside the
# fused attention op a GPU build exports.
MATMULS_VARIANT = "matmuls"
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


def prepare(out: Path, decode_buckets: tuple[int, ...] = (), graphs: bool = False) -> None:
    """Build each precision for the CPU and CUDA, pack what the GPU run needs, and
    record the CPU module's greedy tokens on the synthetic parameters.

    The build is `kiln serve`'s for a GPU (its decodes take dynamic shapes); `decode_buckets`
    adds fixed-shape decodes of those context lengths, which every figure of `run` then goes
    through where a row's context fits (and `run` compares them with decode_bs<N>); `graphs`
    packs each precision's build for CUDA graphs beside it too (pack_graphs)."""
    from benchmarks.kiln_offline import build_in_child
    from benchmarks.peers import weights

    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(weights.hf_dir() / "config.json", out / "hf_config.json")
    for name, (dtype, _) in PRECISIONS.items():
        # CUDA at the default arch (sm_80): its PTX, which the driver compiles for the GPU at hand.
        # As `kiln build --targets cuda` exports it: attention one fused op, the sampler beside.
        options = (f"replace(default_build_options({dtype!r}, quantize='none', cpu_kernels=False), "
                   "attention='fused', sampling_functions=True)")
        if decode_buckets:
            options = f"replace({options}, decode_buckets={decode_buckets!r})"
        # ROCm (gfx942) too, for its dispatch counts beside CUDA's.
        built = build_in_child(options, targets=("cpu", "cuda", "rocm"))
        package = out / name
        package.mkdir(exist_ok=True)
        # The CPU module too: `run --device local-task` tries the whole run here first.
        for file in ("model_cuda.vmfb", "model_cpu.vmfb", *MODEL_FILES):
            shutil.copy(built / file, package / file)
        counts = {target: dispatch_counts(built / f"model_{target}.vmfb") for target in ("cuda", "rocm")}
        (package / "dispatches.json").write_text(json.dumps(counts, indent=2) + "\n")
        print(f"{name}: dispatches per call {counts}", file=sys.stderr)
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
        pack_variant(out, name, f"replace({options}, attention='matmuls')", MATMULS_VARIANT)
        if graphs and name in GRAPH_PRECISIONS:
            pack_graphs(out, name, options)


def pack_variant(out: Path, name: str, options: str, variant: str, flags: tuple[str, ...] = ()) -> Path:
    """`name`'s build with other `options` (CUDA only), packed as `<name>-<variant>` beside it with
    its CPU tokens, so `run` measures one against the other on the same GPU."""
    from benchmarks.kiln_offline import build_in_child

    built = build_in_child(options, targets=("cuda",), flags=flags)
    package = out / f"{name}-{variant}"
    package.mkdir(exist_ok=True)
    for file in ("model_cuda.vmfb", *MODEL_FILES):
        shutil.copy(built / file, package / file)
    (package / "manifest.json").write_text(json.dumps(parameter_manifest((built / "model.mlir").read_text())))
    shutil.copy(out / name / "cpu_tokens.json", package / "cpu_tokens.json")
    print(f"{name}: packed {package}", file=sys.stderr)
    return package


def pack_graphs(out: Path, name: str, options: str) -> None:
    """`name`'s build with fixed-shape decodes (GRAPH_BUCKETS) at batch 1 and 8, compiled with no
    concurrency between dispatches, packed as `<name>-graphs` to run with CUDA graphs
    (GRAPH_DEVICE_FLAGS).

    IREE's CUDA driver launches a command buffer kernel by kernel on a stream unless told to
    record it as a CUDA graph, and its graph command buffer takes at most 32 nodes between two
    barriers: the debug partitioning puts a barrier after every dispatch. A fixed-shape decode's
    command buffer is recorded once, at load, so each step is one graph launch."""
    package = pack_variant(out, name, f"replace({options}, decode_buckets={GRAPH_BUCKETS!r}, decode_batch_sizes=(1, 8))",
                           "graphs", GRAPH_COMPILE_FLAGS)
    (package / "device_flags.json").write_text(json.dumps(list(GRAPH_DEVICE_FLAGS)))


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def measure_package(package: Path, device: str) -> dict:
    """Greedy tokens against the CPU build's, the offline figures and the fixed-shape decodes
    against decode_bs<N>, for one package; the package's device_flags.json (if any) goes to
    IREE's runtime first, so this runs in a process of its own (measure_in_child)."""
    from benchmarks.kiln_offline import measure
    from kiln.runtime.config import load_model_config
    from kiln.runtime.contract import device_target

    flags_file = package / "device_flags.json"
    flags = json.loads(flags_file.read_text()) if flags_file.exists() else []
    if flags:
        from iree import runtime as ireert

        ireert.flags.parse_flags(*flags)
    manifest = json.loads((package / "manifest.json").read_text())
    write_parameters(manifest, package / "model.irpa")
    expected = json.loads((package / "cpu_tokens.json").read_text())
    got = greedy_tokens(_artifacts(package, device_target(device)), device)
    agree = [_first_difference(e, g) for e, g in zip(expected, got)]
    print(f"{package.name}: greedy tokens equal to the CPU build's for {agree} of {PARITY_TOKENS}", file=sys.stderr)
    entry = {"kiln": measure(package, device=device), "tokens_equal_to_cpu": agree, "tokens_compared": PARITY_TOKENS,
             **({"device_flags": flags} if flags else {})}
    if load_model_config(package / "model.json")[1].sample_batch_sizes:  # the same module, sampling on the host
        entry["kiln_host_sampling"] = measure(package, device=device, device_sampling=False)
    if fixed := fixed_decode_pairs(package, device):
        entry["fixed_decode"] = fixed
    return entry


def measure_in_child(package: Path, device: str, timeout: float = 300) -> dict:
    """measure_package in a process of its own; {"error": ...} if it fails or outlasts `timeout`
    (its stderr, passed through, says why), so the run goes on to what it can still measure."""
    command = [sys.executable, "-m", "benchmarks.gpu_bench", "measure", str(package), "--device", device]
    try:
        done = subprocess.run(command, stdout=subprocess.PIPE, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"no result in {timeout:.0f} s"}
    if done.returncode:
        return {"error": f"exit status {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def torch_peer(packed: Path, device: str, dtype: str, compiled: bool = False) -> dict:
    """transformers_bench's offline figures for a model of the packed config's shapes (random
    weights); `compiled`: decode through torch.compile's CUDA graphs over a static cache."""
    with tempfile.TemporaryDirectory() as hf:
        shutil.copy(packed / "hf_config.json", Path(hf) / "config.json")
        peer = subprocess.run(
            [sys.executable, str(Path(__file__).with_name("peers") / "transformers_bench.py"), "offline", hf,
             "--device", device, "--dtype", dtype, "--random-weights", *(["--compile"] if compiled else [])],
            check=True, stdout=subprocess.PIPE, text=True)
    return json.loads(peer.stdout.strip().splitlines()[-1])


def run(packed: Path, device: str, output: Path | None) -> int:
    """Parity and offline figures per precision beside eager PyTorch, `kiln serve` answering and
    under load, then decode beside torch.compile; each result written to `output` as it lands,
    so what is measured survives a later failure or the end of the machine's time."""
    from kiln.runtime.contract import device_target

    target = device_target(device)
    torch_device = "cpu" if target == "cpu" else "cuda"  # ROCm's PyTorch names its GPUs cuda too
    results = {"device": device, "precisions": {}}

    def save():
        if output:
            output.write_text(json.dumps(results, indent=2) + "\n")

    failed = False
    for name, (_, torch_dtype) in PRECISIONS.items():
        entry = measure_in_child(packed / name, device)
        failed |= "error" in entry
        entry["torch"] = torch_peer(packed, torch_device, torch_dtype)
        counts = packed / name / "dispatches.json"
        if counts.exists():
            entry["dispatches"] = json.loads(counts.read_text())
        results["precisions"][name] = entry
        # float32 on both sides: greedy tokens match the CPU build's; bf16 rounds differently per
        # reduction order, so its agreement is reported, not required.
        failed |= name == "f32" and min(entry.get("tokens_equal_to_cpu", [0])) < PARITY_TOKENS
        print(f"{name}: {entry}", file=sys.stderr)
        save()
        for variant in (MATMULS_VARIANT, "graphs"):
            if (packed / f"{name}-{variant}").exists():
                results["precisions"][f"{name}-{variant}"] = measure_in_child(packed / f"{name}-{variant}", device)
                print(f"{name}-{variant}: {results['precisions'][f'{name}-{variant}']}", file=sys.stderr)
                save()
    package = packed / SERVING_PRECISION
    with kiln_server(package, device) as base:
        served = serve_check(base)
        results["serve"] = served
        print(f"kiln serve on {device}: {served}", file=sys.stderr)
        failed |= not (served["completion_status"] == 200 and served["completion_tokens"] == 8
                       and served["stream_status"] == 200 and served["stream_done"])
        save()
        results["serving"] = {"precision": SERVING_PRECISION, "input_tokens": SERVING_INPUT,
                              "output_tokens": SERVING_OUTPUT, **serving_figures(base, package / "tokenizer.json")}
        save()
    if torch_device == "cuda":
        for name in COMPILED_PEER_PRECISIONS:
            torch_dtype = PRECISIONS[name][1]
            try:
                results["precisions"][name]["torch_compiled"] = torch_peer(packed, torch_device, torch_dtype, True)
            except subprocess.CalledProcessError as error:  # its stderr, passed through, says why
                print(f"{name}: torch.compile's peer failed ({error})", file=sys.stderr)
                continue
            print(f"{name}: torch.compile {results['precisions'][name]['torch_compiled']}", file=sys.stderr)
            save()
    print(report(results))
    save()
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


@contextlib.contextmanager
def kiln_server(package: Path, device: str, port: int = 8431):
    """`kiln serve` on the package's module for `device`, healthy; yields its base URL."""
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
        yield base
    finally:
        server.terminate()
        server.wait(timeout=30)


def serve_check(base: str) -> dict:
    """A completion and a streamed chat answer over HTTP."""
    status, body = _post(base + "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 8,
                                                   "temperature": 0, "ignore_eos": True})
    completion = json.loads(body)
    status_stream, stream = _post(base + "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, "stream": True})
    chunks = [line for line in stream.decode().splitlines() if line.startswith("data: {")]
    return {"completion_status": status, "completion_tokens": completion["usage"]["completion_tokens"],
            "stream_status": status_stream, "stream_chunks": len(chunks),
            "stream_done": stream.decode().rstrip().endswith("data: [DONE]")}


def serving_figures(base: str, tokenizer: Path) -> dict:
    """benchmarks.loadgen against the server at each of SERVING_CONCURRENCY: random prompts of
    SERVING_INPUT tokens, SERVING_OUTPUT greedy tokens each, streamed, all sent at once under the
    concurrency cap."""
    from benchmarks import loadgen

    figures = {}
    for concurrency in SERVING_CONCURRENCY:
        requests = max(8, 2 * concurrency)
        workload = loadgen.make_workload("random", str(tokenizer), requests, 0, input_len=SERVING_INPUT,
                                         output_len=SERVING_OUTPUT)
        metrics, _ = loadgen.bench("openai", base, workload, concurrency=concurrency)
        figures[f"c{concurrency}"] = {key: metrics[key] for key in SERVING_KEYS}
        print(f"serving at concurrency {concurrency}: {figures[f'c{concurrency}']}", file=sys.stderr)
    return figures


def report(results: dict) -> str:
    rows = ["| precision | engine | decode bs1 tok/s | decode bs8 tok/s | prefill 128 ms | prefill 512 ms |",
            "|---|---|---:|---:|---:|---:|"]
    for name, entry in results["precisions"].items():
        if "kiln" not in entry:
            rows.append(f"| {name} | kiln | {entry['error']} | | | |")
            continue
        engines = [engine for engine in ("kiln", "kiln_host_sampling", "torch") if engine in entry]
        for engine in engines:
            f = entry[engine]
            rows.append(f"| {name} | {engine} | {f['decode_bs1_tok_s']:.1f} | {f['decode_bs8_tok_s']:.1f} | "
                        f"{f['prefill_128_ms']:.2f} | {f['prefill_512_ms']:.2f} |")
        if "torch" not in entry:  # a variant of a precision: Kiln's figures alone
            continue
        k, t = entry["kiln"], entry["torch"]
        rows.append(f"| {name} | kiln / torch | {k['decode_bs1_tok_s'] / t['decode_bs1_tok_s']:.2f}x | "
                    f"{k['decode_bs8_tok_s'] / t['decode_bs8_tok_s']:.2f}x | "
                    f"{t['prefill_128_ms'] / k['prefill_128_ms']:.2f}x | {t['prefill_512_ms'] / k['prefill_512_ms']:.2f}x |")
        if compiled := entry.get("torch_compiled"):
            rows.append(f"| {name} | torch.compile | {compiled['decode_bs1_tok_s']:.1f} | "
                        f"{compiled['decode_bs8_tok_s']:.1f} | | |")
            rows.append(f"| {name} | kiln / torch.compile | "
                        f"{k['decode_bs1_tok_s'] / compiled['decode_bs1_tok_s']:.2f}x | "
                        f"{k['decode_bs8_tok_s'] / compiled['decode_bs8_tok_s']:.2f}x | | |")
    fixed = {name: entry["fixed_decode"] for name, entry in results["precisions"].items() if "fixed_decode" in entry}
    if fixed:
        rows += ["", fixed_decode_table({"results": fixed})]
    if serving := results.get("serving"):
        title = (f"kiln serve, {serving['precision']}, {serving['input_tokens']} tokens in, "
                 f"{serving['output_tokens']} out:")
        rows += ["", title, "",
                 "| concurrency | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | failed |",
                 "|---:|---:|---:|---:|---:|---:|---:|"]
        for concurrency in SERVING_CONCURRENCY:
            if f := serving.get(f"c{concurrency}"):
                rows.append(f"| {concurrency} | {f['output_throughput']:.1f} | {f['p50_ttft_ms']:.1f} | "
                            f"{f['p99_ttft_ms']:.1f} | {f['p50_itl_ms']:.2f} | {f['p99_itl_ms']:.2f} | {f['failed']} |")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("-o", "--output", type=Path, required=True)
    p.add_argument("--decode-buckets", default="",
                   help="fixed-shape decodes of these context lengths (comma-separated multiples of 16), "
                   "compared with decode_bs<N> on the GPU")
    p.add_argument("--graphs", action="store_true", help="also pack each precision to decode through CUDA graphs")
    m = sub.add_parser("measure", help="one package's Kiln figures as JSON (run's child)")
    m.add_argument("package", type=Path)
    m.add_argument("--device", default="cuda")
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
        prepare(args.output, buckets, args.graphs)
        return 0
    if args.command == "measure":
        print(json.dumps(measure_package(args.package, args.device)))
        return 0
    return run(args.packed, args.device, args.output)


if __name__ == "__main__":
    sys.exit(main())
