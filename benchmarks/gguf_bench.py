"""A GGUF file in Kiln beside llama.cpp on the same file: by default Gemma 3 270M (the `gemma3`
extra's Q4_K_M), or any GGUF Kiln serves (`--model PATH`, or a packaged model's name).

    python -m benchmarks.gguf_bench [--model gemma-3-270m] [--tokens 48] [--output FILE]

Three things, each engine in its own process, one after the other:
- greedy tokens for a few prompts from both, and where they first differ, how close Kiln's two
  best candidates were there (a near tie, whose order rounding may swap, or a real difference),
  and which of the two tokens the float32 model on the file's dequantized weights (what
  transformers computes, tests/models/test_gemma3_gguf.py) prefers on the same prefix, by how much:
  both engines round activations for their quantized matmuls, so each may leave it;
- the offline figures every peer reports (benchmarks/kiln_offline.py's definitions: prefill of
  128 and 512 tokens, decode at batch 1 and 8, 2 threads for llama.cpp);
- each process's peak resident memory, beside the file's size.

Kiln serves the file as `kiln serve --model FILE` builds it (its own GGUF blocks kept where the
CPU kernels take them). The build runs in a child process, so the measuring one never loads torch.
Results go to results/<the file's stem>-<date>.json unless --output says otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

from benchmarks.kiln_offline import build_in_child
from benchmarks.peers import llamacpp
from benchmarks.peers.common import heavy_lock, log

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village by the sea,",
           "The three primary colors are"]
# With --chat: each a user's message, rendered by the model's chat template (an instruct model's use).
CHAT_PROMPTS = ["What is the capital of France?", "Write a Python function that reverses a string.",
                "Give me three tips for sleeping well.", "Explain recursion in one sentence."]
NEAR_TIE = 0.05  # nats between Kiln's two best candidates: closer than this, rounding may swap them


def run_measured(argv: list[str], cwd: Path | None = None) -> tuple[dict, float]:
    """The JSON object `argv` prints last, and the process's peak resident memory in MiB."""
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, cwd=cwd)
    out = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{argv[:3]} failed; stdout:\n{out[-2000:]}")
    line = next(line for line in reversed(out.splitlines()) if line.startswith("{"))
    return json.loads(line), usage.ru_maxrss / 1024


def kiln_greedy(artifacts: Path, prompts: list[str], tokens: int, chat: bool = False) -> dict:
    """In this process (no torch): each prompt's ids, greedy tokens, and Kiln's top-2 logprobs per
    step; with `chat`, each prompt a user's message in the model's chat template."""
    from kiln.runtime import LLM, SamplingParams
    from kiln.runtime.chat import render_chat_template

    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, logprobs=2)
    with LLM(artifacts, prefix_sharing="none") as llm:
        if chat:
            config = llm.service.tokenizer_config
            prompts = [llm.service.encode(render_chat_template(config, [{"role": "user", "content": p}]), False)
                       for p in prompts]
        results = llm.generate(prompts, params)
    return {"runs": [{"prompt_ids": r.prompt_token_ids, "tokens": r.completions[0].token_ids,
                      "top2": [sorted(step.top.values(), reverse=True)[:2] for step in r.completions[0].logprobs]}
                     for r in results]}


def float32_preference(path: Path, prefixes: list[list[int]], pairs: list[tuple[int, int]]) -> dict:
    """In this process (it loads torch): for each prefix, the float32 model's log-probability of the
    first token of its pair less that of the second (positive: it prefers the first)."""
    import torch

    from kiln.models.gguf_loader import load_gguf
    from kiln.models.llama import PagedLlama

    checkpoint = load_gguf(path)
    model = PagedLlama(checkpoint.config).load_tensors(checkpoint.tensors).eval()
    margins = []
    with torch.no_grad():
        for prefix, (first, second) in zip(prefixes, pairs):
            scores = torch.log_softmax(model.forward_reference(torch.tensor([prefix]))[0, -1], dim=-1)
            margins.append(round(float(scores[first] - scores[second]), 4))
    return {"margins": margins}


def compare(kiln: dict, llama: list[list[int]]) -> list[dict]:
    """Per prompt: the tokens both give before they first differ, and Kiln's margin there."""
    rows = []
    for run, theirs in zip(kiln["runs"], llama):
        ours = run["tokens"]
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        row = {"prompt_ids": run["prompt_ids"], "agree": first is None, "kiln": ours, "llama.cpp": theirs}
        if first is not None:
            best, second = run["top2"][first]
            row |= {"first_difference": first, "kiln_margin_nats": round(best - second, 4),
                    "near_tie": best - second < NEAR_TIE}
        rows.append(row)
    return rows


def referee(path: Path, rows: list[dict], here: Path) -> None:
    """Each difference's float32 verdict (float32_preference in a child), into its row."""
    split = [row for row in rows if not row["agree"]]
    if not split:
        return
    prefixes = [row["prompt_ids"] + row["kiln"][:row["first_difference"]] for row in split]
    pairs = [(row["kiln"][row["first_difference"]], row["llama.cpp"][row["first_difference"]]) for row in split]
    verdict, _ = run_measured([sys.executable, "-m", "benchmarks.gguf_bench", "--float32-preference",
                               json.dumps({"path": str(path), "prefixes": prefixes, "pairs": pairs})], here)
    for row, margin in zip(split, verdict["margins"]):
        row["float32_prefers"] = "kiln" if margin > 0 else "llama.cpp"
        row["float32_margin_nats"] = abs(margin)


def speed_ratios(kiln: dict, theirs: dict) -> dict:
    """Kiln's speed over llama.cpp's for each figure both report (above 1: Kiln faster); a time
    in ms is inverted, a rate in tok/s is not."""
    ratios = {}
    for key, ours in kiln.items():
        if key.startswith(("prefill_", "decode_")) and isinstance(ours, (int, float)) and theirs.get(key):
            ratios[key] = round(theirs[key] / ours if key.endswith("_ms") else ours / theirs[key], 3)
    return ratios


def median_of_rounds(rounds: list[dict]) -> dict:
    """Each engine's median figure over the rounds (peak memory: the largest), the median of each
    round's speed ratio, and the rounds themselves."""
    out: dict = {"rounds": rounds}
    for name in ("kiln", "llama.cpp"):
        runs = [r[name] for r in rounds]
        out[name] = {key: (max if key == "peak_rss_mib" else statistics.median)(run[key] for run in runs)
                     for key, value in runs[0].items() if isinstance(value, (int, float))}
    keys = rounds[0]["speed_ratios"]
    out["speed_ratios"] = {key: statistics.median(r["speed_ratios"][key] for r in rounds) for key in keys}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma-3-270m",
                        help="a GGUF file, a packaged model's name, or `default` (the bundled SmolLM2)")
    parser.add_argument("--tokens", type=int, default=48, help="greedy tokens per prompt")
    parser.add_argument("--output", type=Path, help="where the results go (default: results/<stem>-<date>.json)")
    parser.add_argument("--greedy-only", action="store_true", help="leave out the timings")
    parser.add_argument("--chat", action="store_true", help="greedy replies to user messages in the chat template")
    parser.add_argument("--artifacts", type=Path, help="the file's build (`kiln build --output-dir`), not built here")
    parser.add_argument("--rounds", type=int, default=1,
                        help="timing rounds, the engines' order alternating (default: 1); medians are reported")
    parser.add_argument("--kiln-greedy", type=Path, help=argparse.SUPPRESS)  # the children's parts
    parser.add_argument("--float32-preference", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.kiln_greedy:
        print(json.dumps(kiln_greedy(args.kiln_greedy, CHAT_PROMPTS if args.chat else PROMPTS, args.tokens,
                                     args.chat)))
        return 0
    if args.float32_preference:
        asked = json.loads(args.float32_preference)
        print(json.dumps(float32_preference(Path(asked["path"]), asked["prefixes"], asked["pairs"])))
        return 0

    from kiln.models.default_model import default_model_path
    from kiln.models.packaged import resolve_model_path

    bundled = args.model == "default"  # the default model's file, built as `kiln serve` builds it
    path = default_model_path() if bundled else Path(resolve_model_path(args.model)).resolve()
    output = args.output or Path(__file__).parent / "results" / f"{path.stem.lower()}-{date.today().isoformat()}.json"
    # As `kiln serve --model FILE` builds it (the default model: as `kiln serve` with no model does).
    artifacts = args.artifacts or build_in_child("default_build_options()", model=None if bundled else path)
    py = llamacpp.python()  # llama-cpp-python alone: no llama-server build
    here = Path(__file__).resolve().parent.parent
    bench = str(llamacpp.BENCH_SCRIPT)
    with heavy_lock():
        kiln, _ = run_measured([sys.executable, "-m", "benchmarks.gguf_bench", "--tokens", str(args.tokens),
                                "--kiln-greedy", str(artifacts), *(["--chat"] if args.chat else [])], here)
        theirs = [run_measured([str(py), bench, "greedy", str(path), json.dumps(run["prompt_ids"]),
                                str(args.tokens)])[0]["tokens"] for run in kiln["runs"]]
        result = {"model": str(path), "file_mib": round(path.stat().st_size / 2**20, 1), "chat": args.chat,
                  "greedy": compare(kiln, theirs)}
        referee(path, result["greedy"], here)
        if not args.greedy_only:
            started = time.monotonic()
            measure = {"kiln": [sys.executable, "-m", "benchmarks.kiln_offline", "--measure", str(artifacts)],
                       "llama.cpp": [str(py), bench, "offline", str(path)]}
            rounds = []
            for index in range(args.rounds):
                order = list(measure) if index % 2 == 0 else list(measure)[::-1]
                timed = {}
                for name in order:
                    figures, rss = run_measured(measure[name], here)
                    timed[name] = {**figures, "peak_rss_mib": round(rss, 1)}
                rounds.append({"order": order, **timed, "speed_ratios": speed_ratios(timed["kiln"], timed["llama.cpp"])})
            result |= median_of_rounds(rounds)
            result["llama.cpp"]["llama_cpp_python"] = llamacpp.VERSION
            log(f"timed both in {time.monotonic() - started:.0f} s")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("greedy", "rounds")} | {
        "greedy": [{k: v for k, v in row.items() if k not in ("kiln", "llama.cpp", "prompt_ids")}
                   for row in result["greedy"]]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
