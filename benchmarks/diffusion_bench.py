"""Diffusion LMs on Kiln: denoise cost beside AR decode, tokens per forward, torch vs Kiln end to end.

What a denoise call costs beside an AR decode step, how many tokens each mode commits per
forward, and the same algorithm end to end, torch eager against Kiln's compiled path.

    python -m benchmarks.diffusion_bench [--work-dir DIR] [--repeats 5]

No diffusion weights exist offline, so the cost is measured on SmolLM2-135M's real shapes
exported bidirectionally (model_kind "diffusion", mask token <empty_output>, id 16: a
control token of its tokenizer that its chat template never emits): the text is
meaningless, the cost per forward is real. Tokens per forward come from Kiln's torch
reference (tests/diffusion_reference.py; the test suite proves the runtime commits what
it commits) on a tiny random LLaDA, whose confidences are not a trained model's.

Builds and every torch run happen in child processes, so the process that times Kiln
never loads torch. Figures, not asserts: ratios are what to quote on a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.kiln_offline import _random_prompts, build_artifacts
from benchmarks.peers.common import heavy_lock
from kiln.runtime.diffusion.params import DiffusionParams

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).parent / "results"
MASK_TOKEN_ID = 16  # SmolLM2's <empty_output>
PROMPT, CANVAS, BLOCK = 64, 256, 32  # the call timings: a 64-token prompt, a 256-token canvas
DUAL_BLOCK_START = PROMPT + 4 * BLOCK  # a block mid-canvas (the cost is the same for any block)
BATCHES = (1, 8)
# denoise returns logits [N, T, V]; denoise_top (exported on request) the [N, T, 4] summary a greedy commit reads.
DENOISE_FUNCTIONS = ("denoise", "denoise_top")
E2E_TOKENS = 64
E2E_MODE = DiffusionParams(block_length=BLOCK, threshold=0.9, cache="dual")
TINY_PROMPTS, TINY_PROMPT_LEN = 4, 16
# Tokens per forward: LLaDA's fixed schedule (one token a pass), then Fast-dLLM's threshold with each cache.
MODES = {"LLaDA fixed schedule (steps = gen length)": DiffusionParams(steps=E2E_TOKENS, block_length=BLOCK)}
MODES.update({f"Fast-dLLM threshold {t}, cache {c}": DiffusionParams(block_length=BLOCK, threshold=t, cache=c)
              for t in (0.9, 0.5) for c in ("none", "prefix", "dual")})


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def reference_kwargs(params: DiffusionParams, max_tokens: int) -> dict:
    """The torch reference's arguments for what Kiln plans from these params."""
    plan = params.plan(max_tokens)
    return dict(gen_length=plan.canvas_length, block_length=plan.block_length, steps=plan.steps_per_block * plan.blocks,
                threshold=params.threshold, cache=params.cache)


def e2e_prompts() -> list[list[int]]:
    """The end-to-end requests: 8 prompts of 64 random ordinary ids, the same in every process."""
    return _random_prompts(max(BATCHES), PROMPT, 49152, np.random.default_rng(0))


def break_even(denoise_ms: float, decode_ms: float) -> float:
    """Tokens a denoise row must commit per forward to match AR decode's tokens/s per row.

    Both calls carry the same real rows (one, or eight), so the ratio of the calls is the
    ratio per row: a decode step gives each row one token."""
    return denoise_ms / decode_ms


def timed(fn) -> tuple[float, object]:
    """(seconds, result) of one call of `fn`."""
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


def median_ms(fn, repeats: int) -> float:
    """Median wall time of `fn` after one warm-up call."""
    fn()
    return statistics.median(timed(fn)[0] for _ in range(repeats)) * 1e3


# -- children: everything that needs torch ------------------------------------------------
def diffusion_checkpoint():
    """The bundled SmolLM2 as a bidirectional diffusion LM (mask: a special token it never emits)."""
    from kiln.models.loader import load_checkpoint

    checkpoint = load_checkpoint(None)
    added = {a["id"]: a for a in json.loads(checkpoint.tokenizer_json).get("added_tokens", [])}
    assert added[MASK_TOKEN_ID]["special"] and added[MASK_TOKEN_ID]["content"] == "<empty_output>"
    config = checkpoint.config
    config.model_kind, config.mask_token_id, config.logits_shift = "diffusion", MASK_TOKEN_ID, 0
    return checkpoint


def export_options(denoise_top: bool = False):
    from kiln.export.options import ExportOptions

    # 8 rows of the whole 512-token context, page 0 being reserved.
    return ExportOptions(denoise_batch_sizes=BATCHES, max_seq_len=512, device_block_count=8 * 512 // 16 + 1,
                         denoise_top_functions=denoise_top)


def export_bidirectional(work_dir: Path, denoise_top: bool) -> Path:
    """Export and compile (cpu) the bidirectional SmolLM2 into a directory keyed by its inputs; reuse it."""
    from kiln.export.build import artifacts_key
    from kiln.export.compile import compile_vmfb
    from kiln.export.export_model import export_model
    from kiln.runtime.contract import CONFIG_FILE, MLIR_FILE, vmfb_file

    options = export_options(denoise_top)
    directory = work_dir / artifacts_key(None, options, {"diffusion_mask": MASK_TOKEN_ID})
    if not (directory / CONFIG_FILE).exists():
        export_model(diffusion_checkpoint(), options, directory, log=log)
    if not (directory / vmfb_file("cpu")).exists():
        compile_vmfb(directory / MLIR_FILE, directory / vmfb_file("cpu"), "cpu", log=log)
    return directory


def tokens_per_forward() -> dict:
    """Generated tokens and forward passes of each mode on a tiny random LLaDA (torch reference)."""
    import torch

    from kiln.export.export_model import build_model
    from kiln.export.options import ExportOptions
    from kiln.models.loader import load_checkpoint
    from tests.diffusion_model import MASK_ID, VOCAB, write_tiny_llada
    from tests.diffusion_reference import generate

    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory(prefix="kiln-tiny-llada-") as scratch:
        checkpoint = load_checkpoint(write_tiny_llada(scratch))
    model = build_model(checkpoint, ExportOptions().validate(256))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(MASK_ID + 1, VOCAB, TINY_PROMPT_LEN).tolist() for _ in range(TINY_PROMPTS)]
    out = {}
    for name, params in MODES.items():
        runs = [generate(model, p, mask_id=MASK_ID, **reference_kwargs(params, E2E_TOKENS)) for p in prompts]
        out[name] = {"tokens": sum(len(r.tokens) for r in runs), "forward_passes": sum(r.forward_passes for r in runs)}
    return out


def torch_end_to_end(repeats: int) -> dict:
    """The reference (what dfastllm and dlmserve run: upstream's batch-1 cached generate) on
    the bidirectional SmolLM2: the requests one after another."""
    import torch

    from kiln.export.export_model import build_model
    from tests.diffusion_reference import generate

    torch.set_num_threads(2)
    checkpoint = diffusion_checkpoint()
    model = build_model(checkpoint, export_options().validate(checkpoint.config.max_position_embeddings))
    kwargs = dict(mask_id=MASK_TOKEN_ID, **reference_kwargs(E2E_MODE, E2E_TOKENS))

    def run(prompts):
        return [generate(model, p, **kwargs) for p in prompts]

    return timed_batches(run, lambda r: (len(r.tokens), r.forward_passes), repeats)


def timed_batches(run, counts, repeats: int) -> dict:
    """Wall time (median), tokens and passes of `run` on the first 1 and 8 e2e prompts, after a warm-up."""
    prompts = e2e_prompts()
    run(prompts[:1])
    out = {}
    for batch in BATCHES:
        runs = [timed(lambda: run(prompts[:batch])) for _ in range(repeats)]
        seconds = statistics.median(elapsed for elapsed, _ in runs)
        tokens, passes = (sum(values) for values in zip(*map(counts, runs[-1][1])))
        out[f"bs{batch}"] = {"seconds": seconds, "tokens": tokens, "forward_passes": passes,
                             "tokens_per_s": tokens / seconds}
    return out


# -- the timing process: Kiln only, no torch -----------------------------------------------
def page_table(rows: int, tokens: int, stride: int, size: int | None = None) -> np.ndarray:
    """Block ids [size, B] giving each of `rows` rows its own pages for `tokens` tokens;
    rows past `rows` are padding (page 0, as Kiln pads a call)."""
    blocks = -(-tokens // stride)
    table = np.zeros((size or rows, blocks), np.int64)
    table[:rows] = np.arange(1, rows * blocks + 1).reshape(rows, blocks)
    return table


def call_timings(diffusion_dir: Path, ar_dir: Path, repeats: int) -> dict:
    """Median ms of each denoise call shape and of an AR decode step, through Program.invoke
    (the logits copied to host, as the service does)."""
    from kiln.runtime import Artifacts, Program

    rng = np.random.default_rng(0)
    seq_len = PROMPT + CANVAS
    denoiser, decoder = Program(Artifacts.in_directory(diffusion_dir)), Program(Artifacts.in_directory(ar_dir))
    stride = denoiser.params.paged_kv_cache.block_seq_stride
    functions = [f for f in DENOISE_FUNCTIONS if f"{f}_bs{BATCHES[0]}" in denoiser.functions]
    out = {f"{function}_{shape}": {} for function in functions for shape in ("full", "dual")}
    out["decode"] = {}
    for batch in BATCHES:
        table = page_table(batch, seq_len, stride)
        cache = denoiser.allocate_cache(table.size + 1)
        tokens = rng.integers(100, 32000, (batch, seq_len))
        lens = np.full(batch, seq_len)
        shapes = {"full": (tokens, np.zeros(batch, np.int64), lens, table, cache),
                  "dual": (tokens[:, DUAL_BLOCK_START : DUAL_BLOCK_START + BLOCK], np.full(batch, DUAL_BLOCK_START),
                           lens, table, cache)}
        for function in functions:
            for shape, args in shapes.items():
                name = f"{function}_bs{batch}"
                out[f"{function}_{shape}"][f"bs{batch}"] = median_ms(lambda: denoiser.invoke(name, *args), repeats)
        del cache, shapes
        # AR decode of token seq_len + 1, in the smallest decode batch that holds the rows (as the server runs it).
        size = min(s for s in decoder.params.decode_batch_sizes if s >= batch)
        table = page_table(batch, seq_len + 1, stride, size)
        step = (np.zeros((size, 1), np.int64), np.ones(size, np.int64), np.zeros(size, np.int64), table,
                decoder.allocate_cache(table.size + 1))
        step[0][:batch], step[1][:batch], step[2][:batch] = rng.integers(100, 32000, (batch, 1)), seq_len + 1, seq_len
        out["decode"][f"bs{batch}"] = median_ms(lambda: decoder.invoke(f"decode_bs{size}", *step), 4 * repeats)
    return out


def kiln_end_to_end(diffusion_dir: Path, repeats: int) -> dict:
    """The same requests through GenerateService: 8 submitted at once share its denoise calls."""
    from kiln.runtime import Artifacts, GenerateService, SamplingParams, ServiceConfig

    params = SamplingParams(max_tokens=E2E_TOKENS, temperature=0, ignore_eos=True, diffusion=E2E_MODE)

    async def main():
        service = await GenerateService(ServiceConfig(Artifacts.in_directory(diffusion_dir))).start()
        loop = asyncio.get_running_loop()

        async def one(prompt):
            request = service.submit(prompt, params)
            tokens = 0
            async for event in service.stream(request):
                tokens += len(event.token_ids)
            return tokens, request.forward_passes

        async def batch(prompts):
            return await asyncio.gather(*map(one, prompts))

        def run(prompts):  # timed_batches calls this from a worker thread
            return asyncio.run_coroutine_threadsafe(batch(prompts), loop).result()

        try:
            await batch(e2e_prompts())  # warm up the batch of 8 too
            return await loop.run_in_executor(None, timed_batches, run, lambda r: r, repeats)
        finally:
            await service.stop()

    return asyncio.run(main())


# -- orchestration and report ------------------------------------------------------------
def child(step: str, *args: str):
    """Run one step in a fresh process; its JSON answer (the last line of its stdout)."""
    done = subprocess.run([sys.executable, "-m", "benchmarks.diffusion_bench", "--child", step, *args],
                          check=True, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(work_dir: Path, repeats: int, e2e_repeats: int, denoise_top: bool) -> dict:
    load = os.getloadavg()[0]
    with heavy_lock():
        log("building SmolLM2's AR artifacts (as kiln serve does) and its bidirectional export")
        ar_dir = build_artifacts("float32")
        diffusion_dir = Path(child("export", str(work_dir), str(int(denoise_top))))
        log("tokens per forward on the tiny LLaDA")
        tiny = child("tiny")
        log("torch eager end to end")
        torch_e2e = child("torch", str(e2e_repeats))
        log("timing Kiln's calls")
        calls = call_timings(diffusion_dir, ar_dir, repeats)
        log("Kiln end to end")
        kiln_e2e = kiln_end_to_end(diffusion_dir, e2e_repeats)
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()},
        "model": "SmolLM2-135M-Instruct (bundled, Q4_1 dequantized), float32, exported bidirectionally",
        "mask_token": {"id": MASK_TOKEN_ID, "text": "<empty_output>"},
        "repeats": repeats, "e2e_repeats": e2e_repeats, "torch_threads": 2, "denoise_top": denoise_top,
        "load_average": {"before": load, "after": os.getloadavg()[0]},  # another job's load skews every figure
        "calls_ms": calls,
        "break_even": {call: {bs: break_even(ms, calls["decode"][bs]) for bs, ms in figures.items()}
                       for call, figures in calls.items() if call != "decode"},
        "tokens_per_forward": tiny,
        "end_to_end": {"mode": "dual cache, threshold 0.9, 64 tokens in blocks of 32, 64-token prompts",
                       "torch_eager": torch_e2e, "kiln": kiln_e2e},
    }


def render_table(results: dict) -> str:
    calls, even, e2e = results["calls_ms"], results["break_even"], results["end_to_end"]
    lines = [
        f"Measured {results['date']} on {results['machine']['cpus']} CPUs (load average "
        f"{results['load_average']['before']:.1f} before, {results['load_average']['after']:.1f} after); "
        f"{results['model']} (mask token {results['mask_token']['text']}, id {results['mask_token']['id']}).",
        "",
        f"Per call (median ms of {results['repeats']}, host time and the copy of the results included; prompt "
        f"{PROMPT}, canvas {CANVAS}). denoise returns logits [N, T, V]; denoise_top (--denoise-top) the [N, T, 4] "
        "summary a greedy request reads. Break-even: the tokens a row must commit per forward to match AR "
        "decode's tokens/s per row:",
        "",
        "| call | batch 1 | batch 8 | break-even tokens/forward, batch 1 | batch 8 |",
        "|---|---:|---:|---:|---:|",
    ]
    labels = {"full": f"full canvas (T={PROMPT + CANVAS})", "dual": f"dual-cache block (T={BLOCK}, keys {PROMPT + CANVAS})"}
    for call, figures in calls.items():
        if call != "decode":
            function, shape = call.rsplit("_", 1)
            lines.append(f"| {function}, {labels[shape]} | {figures['bs1']:.1f} | {figures['bs8']:.1f} | "
                         f"{even[call]['bs1']:.1f} | {even[call]['bs8']:.1f} |")
    lines += [
        f"| AR decode step (context {PROMPT + CANVAS}) | {calls['decode']['bs1']:.1f} | "
        f"{calls['decode']['bs8']:.1f} | | |",
        "",
        f"Tokens per forward (torch reference on a tiny random LLaDA, {TINY_PROMPTS} prompts x {E2E_TOKENS} tokens, "
        f"blocks of {BLOCK}; random weights: a trained model's confidences differ):",
        "",
        "| mode | forward passes | tokens/forward |",
        "|---|---:|---:|",
    ]
    for name, row in results["tokens_per_forward"].items():
        lines.append(f"| {name} | {row['forward_passes']} | {row['tokens'] / row['forward_passes']:.2f} |")
    lines += [
        "",
        f"End to end ({e2e['mode']}, greedy: Kiln calls {'denoise_top' if results['denoise_top'] else 'denoise'}; "
        "torch eager runs the requests one after another, Kiln all at once):",
        "",
        "| requests | torch eager s | torch tok/s | Kiln s | Kiln tok/s | Kiln / torch | passes torch / Kiln |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for batch in BATCHES:
        ref, kiln = e2e["torch_eager"][f"bs{batch}"], e2e["kiln"][f"bs{batch}"]
        lines.append(f"| {batch} | {ref['seconds']:.2f} | {ref['tokens_per_s']:.1f} | {kiln['seconds']:.2f} | "
                     f"{kiln['tokens_per_s']:.1f} | {kiln['tokens_per_s'] / ref['tokens_per_s']:.2f}x | "
                     f"{ref['forward_passes']} / {kiln['forward_passes']} |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    from kiln.models.cache import cache_dir

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", type=Path, default=cache_dir() / "bench",
                        help="where the bidirectional export is built and kept (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per figure, after a warm-up")
    parser.add_argument("--e2e-repeats", type=int, default=2, help="timed end-to-end runs per figure")
    parser.add_argument("--denoise-top", action="store_true",
                        help="also export and time denoise_top_bs<N>, which greedy requests then call (Kiln "
                             "exports it only on request; measured 20-40x slower than denoise on CPU: benchmarks/README.md)")
    parser.add_argument("--output", type=Path, help="results file (default: benchmarks/results/diffusion-<date>.json)")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        step, *rest = args.child
        steps = {"export": lambda d, top: str(export_bidirectional(Path(d), top == "1")), "tiny": tokens_per_forward,
                 "torch": lambda n: torch_end_to_end(int(n))}
        print(json.dumps(steps[step](*rest)))
        return 0
    results = measure(args.work_dir, args.repeats, args.e2e_repeats, args.denoise_top)
    output = args.output or RESULTS_DIR / f"diffusion-{datetime.date.today().isoformat()}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=2) + "\n")
    print(render_table(results))
    print(f"\nsaved {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
