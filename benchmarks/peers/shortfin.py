"""shortfin + sharktank as a benchmark peer: AMD's own export of the very weights Kiln serves,
compiled for this CPU and served by shortfin's LLM server.

Pipeline, once, into `<cache>/peers/shortfin/` (the venv) and its `artifacts/` folder:
  weights.hf_dir() --sharktank.tools.import_hf_dataset--> model.irpa
  model.irpa --sharktank.examples.export_paged_llm_v1--> model.mlir + model.json
  model.mlir --iree-compile 3.9 (llvm-cpu, host)-------> model_cpu.vmfb
Every step has a marker holding the versions and options it was made with, so a rerun does
nothing and a change redoes only what depends on it.

    python -m benchmarks.peers.shortfin            # setup, serve, one greedy request, stop
    python -m benchmarks.peers.shortfin --kiln     # also: Kiln's runtime on shortfin's VMFB

What shortfin 3.9.0's `POST /generate` takes and gives (read from its sources and checked):
  in:  {"text": str | [str]} or {"input_ids": [int] | [[int]]},
       "sampling_params": {"max_completion_tokens" (50), "temperature" (clamped to 0.1..2),
       "top_k", "top_p", "n", "num_beams"}, "rid", "stream", "return_input_ids".
       Decoding is greedy whatever the temperature (argmax; beams if num_beams > 1).
  out: {"responses": [{"prompt": text, "responses": [{"text": ...}]}]}, one JSON body.
  `stream` is accepted and ignored (no SSE in 3.9.0); `return_input_ids` crashes the
  handler (it hands a list to Starlette) and the request hangs; there is no `ignore_eos`.
  EOS is the tokenizer_config's `eos_token`: start_server(ignore_eos=True) gives the server a
  tokenizer_config whose `eos_token` is a special token the model never emits, so every
  request runs to `max_completion_tokens` (the text it returns omits special tokens, so
  re-tokenizing it can count fewer).
  The server admits at most max(decode_batch_sizes) requests at once and reserves
  ceil(prompt/stride) + ceil(max_completion_tokens/stride) pages per request up front; a
  request over either limit is refused at once (an error body), not queued.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from .common import free_port, heavy_lock, log, make_venv, peers_dir, wait_http

SHORTFIN = "3.9.0"
SHARKTANK = "3.8.0"
IREE = "3.9.0"  # compiler, runtime and turbine that sharktank 3.8's export works with
TORCH = "2.13.0"
VENV = "shortfin"
REPO = Path(__file__).resolve().parents[2]

# Same serving shape as Kiln's benchmark build: float32 throughout, 16-token pages, prefill
# at batch 1 and 4, decode up to 16 (shortfin refuses more concurrent requests than its
# largest decode batch). 512 pages (sharktank's default) hold 16 requests of 256 + 128
# tokens (24 pages each) and 4 of 1056 + 32 (68 each), which shortfin reserves up front.
EXPORT_OPTIONS = {
    "bs_prefill": "1,4",
    "bs_decode": "1,4,8,16",
    "block_seq_stride": 16,
    "device_block_count": 512,
    "dtype": "float32",
    "has_prefill_position": True,
}
CPU_FLAGS = [
    "--iree-hal-target-device=local",
    "--iree-hal-local-target-device-backends=llvm-cpu",
    "--iree-llvmcpu-target-cpu=host",
    # sharktank's attention needs it on the CPU; raising the stack allocation limit instead
    # compiles, but the module then crashes at run time.
    "--iree-llvmcpu-distribution-size=16",
]
DATA_TILING = "--iree-opt-data-tiling"  # as Kiln compiles for the CPU; dropped if it fails
# A special token of SmolLM2's vocabulary that greedy decoding never emits: as the server's
# EOS, requests run to max_completion_tokens (shortfin has no ignore_eos).
NEVER_EMITTED_TOKEN = "<empty_output>"
PROMPT = "The capital of France is"


@dataclass
class ShortfinPeer:
    python: Path
    vmfb: Path
    irpa: Path
    config: Path  # shortfin's ModelParams JSON, as sharktank wrote it
    tokenizer: Path
    tokenizer_config: Path
    compile_flags: list[str]
    timings: dict  # seconds each build step took when it last ran


def venv_dir() -> Path:
    return peers_dir() / VENV


def artifacts_dir() -> Path:
    return venv_dir() / "artifacts"


def python() -> Path:
    """The venv: shortfin's server and sharktank's export, pinned to each other; a
    constraints file keeps sharktank's dependencies from pulling in another torch."""
    constraints = peers_dir() / "shortfin-constraints.txt"
    constraints.parent.mkdir(parents=True, exist_ok=True)
    text = f"torch=={TORCH}\n"
    if not constraints.exists() or constraints.read_text() != text:
        constraints.write_text(text)
    return make_venv(VENV, [
        f"--constraint={constraints}",
        f"shortfin[apps]=={SHORTFIN}",  # [apps]: fastapi, uvicorn, dataclasses-json, transformers
        f"sharktank=={SHARKTANK}",
        f"wave-lang=={SHARKTANK}",  # sharktank imports it, but does not declare it
        f"iree-base-compiler=={IREE}",
        f"iree-base-runtime=={IREE}",
        f"iree-turbine=={IREE}",
        f"torch=={TORCH}",
    ])


# -- build steps ---------------------------------------------------------------------------------


def _step(name: str, stamp: str, outputs: list[Path], build, timings: dict) -> None:
    """Run `build()` unless the marker for `name` holds `stamp` and every output exists."""
    marker = artifacts_dir() / f".{name}-done"
    if marker.exists() and marker.read_text() == stamp and all(p.exists() for p in outputs):
        return
    marker.unlink(missing_ok=True)
    log(f"shortfin: {name}")
    with heavy_lock():
        start = time.monotonic()  # not counting the wait for the lock
        build()
    timings[name] = round(time.monotonic() - start, 1)
    log(f"shortfin: {name} took {timings[name]:.0f} s")
    marker.write_text(stamp)


def _run(cmd: list[str], log_file: Path) -> None:
    """Run a build command with its output in `log_file`; on failure, show the tail."""
    with open(log_file, "w") as out:
        proc = subprocess.run([str(c) for c in cmd], stdout=out, stderr=subprocess.STDOUT)
    if proc.returncode:
        tail = log_file.read_text(errors="replace").splitlines()[-25:]
        raise RuntimeError(f"{Path(cmd[0]).name} ... failed ({proc.returncode}); end of {log_file}:\n"
                           + "\n".join(tail))


def _rename(partial: Path, target: Path) -> None:
    target.unlink(missing_ok=True)
    partial.rename(target)


def setup() -> ShortfinPeer:
    """The venv and the compiled model, built on first use (about 10 minutes on 2 cores)."""
    from . import weights

    py = python()
    bindir = py.parent
    out = artifacts_dir()
    out.mkdir(parents=True, exist_ok=True)
    timings_file = out / "timings.json"
    timings = json.loads(timings_file.read_text()) if timings_file.exists() else {}

    hf = weights.hf_dir()
    source = f"{weights.source_stamp()} sharktank={SHARKTANK}"

    # Tokenizer files, as shortfin reads them (its server wants tokenizer_config's eos_token).
    tokenizer, tokenizer_config = out / "tokenizer.json", out / "tokenizer_config.json"
    for name, dest in (("tokenizer.json", tokenizer), ("tokenizer_config.json", tokenizer_config)):
        if not dest.exists() or dest.read_bytes() != (hf / name).read_bytes():
            shutil.copyfile(hf / name, dest)

    irpa = out / "model.irpa"

    def import_irpa():
        partial = out / "model.tmp.irpa"
        params = sorted(p.name for p in hf.glob("*.safetensors"))
        _run([py, "-m", "sharktank.tools.import_hf_dataset", "--config-json", hf / "config.json",
              "--params", *params, "--output-irpa-file", partial], out / "import.log")
        _rename(partial, irpa)

    _step("import", source, [irpa], import_irpa, timings)

    mlir, config = out / "model.mlir", out / "model.json"
    opts = EXPORT_OPTIONS
    export_stamp = f"{source} {json.dumps(opts, sort_keys=True)}"

    def export():
        pm, pc = out / "model.tmp.mlir", out / "model.tmp.json"
        cmd = [py, "-m", "sharktank.examples.export_paged_llm_v1", "--irpa-file", irpa,
               "--output-mlir", pm, "--output-config", pc,
               "--bs-prefill", opts["bs_prefill"], "--bs-decode", opts["bs_decode"],
               "--block-seq-stride", opts["block_seq_stride"],
               "--device-block-count", opts["device_block_count"],
               # sharktank defaults to float16 activations and attention; the KV cache
               # follows neither unless told.
               "--activation-dtype", opts["dtype"], "--attention-dtype", opts["dtype"],
               "--kv-cache-dtype", opts["dtype"]]
        if opts["has_prefill_position"]:
            cmd.append("--has-prefill-position")
        _run(cmd, out / "export.log")
        _rename(pc, config)
        _rename(pm, mlir)

    _step("export", export_stamp, [mlir, config], export, timings)

    vmfb = out / "model_cpu.vmfb"
    flags_file = out / "compile_flags.json"
    compile_stamp = f"{export_stamp} iree-compile={IREE} {' '.join(CPU_FLAGS)} try {DATA_TILING}"

    def compile_vmfb():
        partial = out / "model_cpu.tmp.vmfb"
        flags = [*CPU_FLAGS, DATA_TILING]
        try:
            _run([bindir / "iree-compile", mlir, "-o", partial, *flags], out / "compile.log")
        except RuntimeError as e:
            log(f"shortfin: compile with {DATA_TILING} failed, compiling without it: {e}")
            flags = list(CPU_FLAGS)
            _run([bindir / "iree-compile", mlir, "-o", partial, *flags], out / "compile.log")
        _rename(partial, vmfb)
        flags_file.write_text(json.dumps(flags))

    _step("compile", compile_stamp, [vmfb, flags_file], compile_vmfb, timings)
    timings_file.write_text(json.dumps(timings, indent=2))

    return ShortfinPeer(python=py, vmfb=vmfb, irpa=irpa, config=config, tokenizer=tokenizer,
                        tokenizer_config=tokenizer_config,
                        compile_flags=json.loads(flags_file.read_text()), timings=timings)


# -- serving -------------------------------------------------------------------------------------


def _server_files(peer: ShortfinPeer, port: int, ignore_eos: bool, kv_pages: int | None) -> tuple[Path, Path]:
    """The model config and tokenizer_config this server gets: the export's, with the page
    count and the EOS token changed as asked."""
    run_dir = artifacts_dir() / "serve" / str(port)
    run_dir.mkdir(parents=True, exist_ok=True)
    config = json.loads(peer.config.read_text())
    if kv_pages is not None:
        config["paged_kv_cache"]["device_block_count"] = kv_pages  # a dynamic dim of the cache
    config_path = run_dir / "model.json"
    config_path.write_text(json.dumps(config))
    tok_config = json.loads(peer.tokenizer_config.read_text())
    if ignore_eos:
        added = {t["content"] for t in json.loads(peer.tokenizer.read_text()).get("added_tokens", [])}
        if NEVER_EMITTED_TOKEN not in added:
            raise RuntimeError(f"{NEVER_EMITTED_TOKEN!r} is not a token of this model: "
                               "pick another never-emitted token for ignore_eos")
        tok_config["eos_token"] = NEVER_EMITTED_TOKEN
    tok_config_path = run_dir / "tokenizer_config.json"
    tok_config_path.write_text(json.dumps(tok_config))
    return config_path, tok_config_path


def start_server(peer: ShortfinPeer, port: int, *, ignore_eos: bool = True,
                 prefix_sharing: str = "none", kv_pages: int | None = None) -> subprocess.Popen:
    """shortfin's LLM server on 127.0.0.1:`port` (local-task: IREE's CPU task executor). Ready
    when GET /health answers 200 (it does once the model is loaded: the app starts after).
    `ignore_eos`: requests run to max_completion_tokens, like the other engines' ignore_eos.
    `prefix_sharing`: "none" (shortfin's default) or "trie" (Kiln's default). With shortfin
    3.9.0's trie, after 17 requests of 256 + 128 tokens at concurrency 16 the next ones failed
    ("Failed to acquire pages even after attempting eviction from LRU leaves", answered 200
    with an empty `responses` list), so it is not the default here.
    A hung server ignores SIGTERM while requests are open: stop_server() kills it after 30 s.
    Output goes to artifacts/serve/<port>/server.log."""
    config, tok_config = _server_files(peer, port, ignore_eos, kv_pages)
    log_path = config.parent / "server.log"
    cmd = [str(peer.python), "-m", "shortfin_apps.llm.server", "--device", "local-task",
           "--tokenizer_json", str(peer.tokenizer), "--tokenizer_config_json", str(tok_config),
           "--model_config", str(config), "--vmfb", str(peer.vmfb), "--parameters", str(peer.irpa),
           "--prefix_sharing_algorithm", prefix_sharing, "--host", "127.0.0.1", "--port", str(port)]
    log(f"shortfin: serving on port {port}, log {log_path}")
    with open(log_path, "w") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _post(url: str, body: dict, timeout: float = 600) -> tuple[dict, float]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            payload = json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{url} answered {e.code}: {e.read()[:500]!r}") from None
    return payload, time.perf_counter() - start


def generate(base_url: str, text: str, max_tokens: int = 128) -> tuple[str, float]:
    """One greedy /generate request; (text, seconds)."""
    payload, seconds = _post(f"{base_url}/generate", {
        "text": text, "sampling_params": {"max_completion_tokens": max_tokens, "temperature": 0}})
    return payload["responses"][0]["responses"][0]["text"], seconds


def count_tokens(peer: ShortfinPeer, text: str) -> int:
    """Tokens in `text` by re-tokenizing (special tokens the model emitted are not in it)."""
    from tokenizers import Tokenizer

    return len(Tokenizer.from_file(str(peer.tokenizer)).encode(text, add_special_tokens=False).ids)


# -- Kiln's runtime on shortfin's VMFB -------------------------------------------------------------

# Kiln's serving dependencies (pyproject's, less the runtime pin), for a venv whose IREE runtime
# is the one shortfin's VMFB was compiled for.
KILN_SERVE_REQUIREMENTS = [
    f"iree-base-runtime=={IREE}", "numpy>=1.26", "tokenizers>=0.20", "dataclasses-json>=0.6",
    "gguf>=0.10", "safetensors>=0.4", "jinja2>=3.1", "fastapi>=0.115", "pydantic>=2.7",
    "uvicorn>=0.30", "websockets>=12", "prometheus-client>=0.20",
]


def kiln_iree39_python() -> Path:
    """A venv with Kiln (this checkout, editable, without its dependencies) over IREE's
    runtime 3.9.0: Kiln's own pin (3.13) cannot load modules that compiler 3.9 wrote."""
    py = make_venv("kiln-iree39", KILN_SERVE_REQUIREMENTS)
    marker = py.parent.parent / ".kiln-editable"
    if not marker.exists() or marker.read_text() != str(REPO):
        subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "-e", str(REPO)],
                       check=True, stdout=sys.stderr)
        marker.write_text(str(REPO))
    return py


def _kiln_serve(py: Path | str, peer: ShortfinPeer, label: str, max_tokens: int) -> dict:
    """`kiln serve` on shortfin's artifacts (no model.kiln.json sidecar) and one greedy
    /v1/completions request; what happened, errors included."""
    port = free_port()
    log_path = artifacts_dir() / f"kiln-{label}.log"
    cmd = [str(py), "-m", "kiln.cli.main", "serve", "--vmfb", str(peer.vmfb), "--params", str(peer.irpa),
           "--config", str(peer.config), "--tokenizer", str(peer.tokenizer), "--port", str(port),
           "--no-access-log"]
    version = subprocess.run([str(py), "-c", "from importlib.metadata import version; "
                              "print(version('iree-base-runtime'))"], capture_output=True, text=True).stdout.strip()
    result = {"python": str(py), "iree_runtime": version, "log": str(log_path), "ok": False}
    start = time.monotonic()
    with open(log_path, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            text = log_path.read_text(errors="replace")
            if "could not load the model" in text:
                break
            try:
                wait_http(f"http://127.0.0.1:{port}/health", 1, proc)
                break
            except (TimeoutError, RuntimeError):
                pass
        text = log_path.read_text(errors="replace")
        errors = [line for line in text.splitlines() if " ERROR " in line]
        if errors or proc.poll() is not None:
            result["error"] = errors[0] if errors else f"kiln serve exited with {proc.returncode}"
            return result
        result["load_s"] = round(time.monotonic() - start, 1)
        body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        _post(f"http://127.0.0.1:{port}/v1/completions", body)  # warm-up, as for shortfin
        payload, seconds = _post(f"http://127.0.0.1:{port}/v1/completions", body)
        choice = payload["choices"][0]
        result.update(ok=True, text=choice["text"], finish_reason=choice["finish_reason"],
                      completion_tokens=payload["usage"]["completion_tokens"], seconds=round(seconds, 2))
        return result
    finally:
        stop_server(proc)


def kiln_on_shortfin_vmfb(peer: ShortfinPeer | None = None, max_tokens: int = 128) -> dict:
    """Same artifact, two runtimes: Kiln's runtime serving shortfin's VMFB. Tried twice:
    `kiln`, Kiln's own environment (IREE runtime 3.13), and `kiln_iree39`, Kiln's code over
    IREE's runtime 3.9.0, the version the VMFB was compiled for."""
    peer = peer or setup()
    return {"kiln": _kiln_serve(sys.executable, peer, "own-env", max_tokens),
            "kiln_iree39": _kiln_serve(kiln_iree39_python(), peer, "iree39", max_tokens)}


# -- main ----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--kiln", action="store_true", help="also serve shortfin's VMFB with Kiln's runtime")
    args = parser.parse_args(argv)

    start = time.monotonic()
    peer = setup()
    report = {"setup_s": round(time.monotonic() - start, 1), "build_step_s": peer.timings,
              "compile_flags": peer.compile_flags, "peer": {k: str(v) for k, v in asdict(peer).items()
                                                            if k not in ("compile_flags", "timings")}}
    with heavy_lock():  # the requests are timed
        port = free_port()
        start = time.monotonic()
        proc = start_server(peer, port)
        try:
            wait_http(f"http://127.0.0.1:{port}/health", 300, proc)
            report["server_ready_s"] = round(time.monotonic() - start, 1)
            base = f"http://127.0.0.1:{port}"
            text, seconds = generate(base, PROMPT, args.max_tokens)
            report["first_request"] = {"prompt": PROMPT, "text": text, "seconds": round(seconds, 2)}
            text, seconds = generate(base, PROMPT, args.max_tokens)  # warm
            report["request"] = {"prompt": PROMPT, "max_completion_tokens": args.max_tokens, "text": text,
                                 "seconds": round(seconds, 2), "retokenized_tokens": count_tokens(peer, text),
                                 "tokens_per_s": round(args.max_tokens / seconds, 1)}
        finally:
            stop_server(proc)
        if args.kiln:
            report["kiln_on_shortfin_vmfb"] = kiln_on_shortfin_vmfb(peer, args.max_tokens)
            ours = report["kiln_on_shortfin_vmfb"]["kiln_iree39"]
            if ours.get("ok"):
                ours["same_text_as_shortfin"] = ours["text"] == report["request"]["text"]
    print(f"{PROMPT!r} -> {report['request']['text']!r}", file=sys.stderr)
    print(f"{args.max_tokens} tokens in {report['request']['seconds']:.2f} s "
          f"({report['request']['tokens_per_s']} tokens/s, batch 1, prompt of 5 tokens)", file=sys.stderr)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
