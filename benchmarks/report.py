"""Turn a results JSON into what people read: markdown tables, the issue's target ratios,
PNG plots, and the section of benchmarks/README.md between `<!-- bench -->` markers.

    python -m benchmarks.report benchmarks/results/<date>.json    # re-render only
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

BEGIN, END = "<!-- bench -->", "<!-- /bench -->"
README = Path(__file__).resolve().parent / "README.md"  # benchmarks/README.md: the page the tables live on
PLOTS = {"throughput": "serving-throughput.png", "ttft": "serving-ttft.png"}


def _num(value, fmt: str = "{:.1f}") -> str:
    return "–" if value is None else fmt.format(value)


def _offline_rows(results: dict) -> dict[str, dict]:
    return {f"{r['engine']} {r['dtype']}": r for r in results.get("offline", []) if "error" not in r}


def offline_table(results: dict) -> str:
    lines = [
        "| engine | decode bs1 (tok/s) | decode bs8 (tok/s) | prefill 128 (ms) | prefill 512 (ms) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, r in _offline_rows(results).items():
        lines.append(f"| {name} | {_num(r.get('decode_bs1_tok_s'))} | {_num(r.get('decode_bs8_tok_s'))} | "
                     f"{_num(r.get('prefill_128_ms'), '{:.0f}')} | {_num(r.get('prefill_512_ms'), '{:.0f}')} |")
    for dtype, floor in results.get("floor", {}).items():
        lines.append(f"| memory-bandwidth floor, {dtype} weights | {floor['tokens_per_s']:.1f} | | | |")
    return "\n".join(lines)


def _serving_runs(results: dict, key: str) -> dict[str, list[dict]]:
    out = {}
    for name, runs in results.get("serving", {}).items():
        picked = [r for r in runs if "error" not in r and r.get(key) and r.get("completed")]
        if picked:
            out[name] = sorted(picked, key=lambda r: r[key])
    return out


def serving_table(results: dict) -> str:
    lines = [
        "| engine | load | out tok/s | req/s | TTFT p50 / p99 (ms) | TPOT p50 (ms) | ITL p50 / p99 (ms) | failed |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, runs in results.get("serving", {}).items():
        for r in runs:
            if "error" in r:
                lines.append(f"| {name} | – | failed: see results JSON | | | | | |")
                continue
            load = f"concurrency {r['max_concurrency']}" if r.get("max_concurrency") else f"{r['request_rate']} req/s"
            lines.append(
                f"| {name} | {load} | {r['output_throughput']:.1f} | {r['request_throughput']:.2f} | "
                f"{_num(r.get('p50_ttft_ms'), '{:.0f}')} / {_num(r.get('p99_ttft_ms'), '{:.0f}')} | "
                f"{_num(r.get('p50_tpot_ms'))} | {_num(r.get('p50_itl_ms'))} / {_num(r.get('p99_itl_ms'))} | "
                f"{r['failed']} |"
            )
    return "\n".join(lines)


def prefix_table(results: dict) -> str:
    prefix = results.get("prefix", {})
    if not prefix:
        return ""
    lines = ["| kiln --prefix-sharing | TTFT p50 (ms) | TTFT mean (ms) | out tok/s |", "|---|---:|---:|---:|"]
    for sharing, r in prefix.items():
        lines.append(f"| {sharing} | {r['p50_ttft_ms']:.0f} | {r['mean_ttft_ms']:.0f} | {r['output_throughput']:.1f} |")
    return "\n".join(lines)


def paired_table(paired: dict) -> str:
    first, second = paired["engines"]
    lines = [f"| round | order | {first} out tok/s | {second} out tok/s | ratio | TTFT p50 (ms) | ITL p50 (ms) |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for index, entry in enumerate(paired["rounds"], 1):
        runs = [entry["runs"].get(name, {"error": "not run"}) for name in (first, second)]

        def cells(key, fmt):
            return ["failed" if "error" in r else _num(r.get(key), fmt) for r in runs]

        out, ttft, itl = cells("output_throughput", "{:.1f}"), cells("p50_ttft_ms", "{:.0f}"), cells("p50_itl_ms", "{:.0f}")
        lines.append(f"| {index} | {' → '.join(entry['order'])} | {out[0]} | {out[1]} | "
                     f"{_num(entry.get('ratio'), '{:.2f}x')} | {' / '.join(ttft)} | {' / '.join(itl)} |")
    lines.append(f"| median | | | | {_num(paired.get('median_ratio'), '{:.2f}x')} | | |")
    return "\n".join(lines)


def paired_summaries(results: dict) -> list[dict]:
    """The paired step's pairs: a list, or one pair as a dict in results written before it
    took several."""
    paired = results.get("paired") or []
    return [paired] if isinstance(paired, dict) else paired


# The precision step's rows, as the tables name them.
PRECISION_LABELS = {"f32": "f32", "bf16w": "bf16", "int8": "int8", "q8_0": "Q8_0", "q4_1": "Q4_1"}


def precision_table(precision: dict) -> str:
    """The precision step: Kiln's compiled calls per weight precision, and beside llama.cpp."""
    lines = ["| weights | decode step bs1 (ms) | bs8 (ms) | prefill 512 (ms) | floor (ms) | of floor | "
             "vs Kiln f32 (bs1 / bs8 / prefill) | vs llama.cpp: decode bs1 / bs8 | prefill 512 time |",
             "|---|---:|---:|---:|---:|---:|---|---|---:|"]
    for name, r in precision["results"].items():
        up = r.get("speedup_vs_f32")
        ups = " / ".join(f"{up[k]:.2f}x" for k in ("decode_bs1_ms", "decode_bs8_ms", "prefill_512_ms")) if up else "–"
        peer = (r.get("llama_cpp") or {}).get("ratio")
        versus = f"{peer['decode_bs1']:.2f}x / {peer['decode_bs8']:.2f}x ({r['llama_cpp']['type'].upper()})" if peer else "–"
        lines.append(f"| {PRECISION_LABELS.get(name, name)} | {r['decode_bs1_ms']:.1f} | {r['decode_bs8_ms']:.1f} | "
                     f"{r['prefill_512_ms']:.0f} | {r['floor_step_ms']:.1f} | {r['of_floor']:.2f} | {ups} | {versus} | "
                     f"{_num(peer and peer['prefill_512_time'], '{:.2f}x')} |")
    return "\n".join(lines)


def fixed_decode_table(fixed: dict) -> str:
    """The fixed step: each decode through its fixed-shape function and through decode_bs<N>."""
    lines = ["| weights | batch | fixed-shape decode (ms) | decode_bs<N> (ms) | fixed speed-up |",
             "|---|---:|---:|---:|---:|"]
    for name, rows in fixed["results"].items():
        for batch, row in rows.items():
            lines.append(f"| {PRECISION_LABELS.get(name, name)} | {batch.removeprefix('bs')} | {row['fixed_ms']:.2f} | "
                         f"{row['dynamic_ms']:.2f} | {row['speedup']:.2f}x |")
    return "\n".join(lines)


def precision_targets(results: dict) -> list[tuple[str, str, bool | None]]:
    """The weight-precision targets: decode at batch 1 and 8 and prefill beside llama.cpp at the
    same precision, bf16 over Kiln's f32, each precision's share of its bandwidth floor, and
    serving at concurrency 16 beside llama.cpp's server (the paired step's pairs)."""
    rows = []
    measured = (results.get("precision") or {}).get("results", {})
    for name, r in measured.items():
        label = PRECISION_LABELS.get(name, name)
        peer = (r.get("llama_cpp") or {}).get("ratio")
        if peer:
            theirs = r["llama_cpp"]["type"].upper()
            rows.append((f"decode bs1: kiln {label} ≥ 1.0x llama.cpp {theirs}", f"{peer['decode_bs1']:.2f}x",
                         peer["decode_bs1"] >= 1.0))
            rows.append((f"decode bs8: kiln {label} ≥ 1.3x llama.cpp {theirs}", f"{peer['decode_bs8']:.2f}x",
                         peer["decode_bs8"] >= 1.3))
            rows.append((f"prefill 512: kiln {label} ≤ 0.8x llama.cpp {theirs}'s time", f"{peer['prefill_512_time']:.2f}x",
                         peer["prefill_512_time"] <= 0.8))
        rows.append((f"decode bs1: kiln {label} ≥ 0.85 of its bandwidth floor", f"{r['of_floor']:.2f}", r["of_floor"] >= 0.85))
    bf16 = measured.get("bf16w", {}).get("speedup_vs_f32")
    if bf16:
        rows.append(("decode bs1: kiln bf16 ≥ 1.6x kiln f32", f"{bf16['decode_bs1_ms']:.2f}x", bf16["decode_bs1_ms"] >= 1.6))
    for paired in paired_summaries(results):
        first, second = paired["engines"]
        if first.split()[0] != "kiln" or first == "kiln f32" or not paired.get("median_ratio"):
            continue  # kiln f32's pair is among the serving targets below
        r = paired["median_ratio"]
        rows.append((f"serving c=16: {first} out tok/s ≥ 1.2x {second}",
                     f"{r:.2f}x (median of {paired['paired_rounds']} paired rounds)", r >= 1.2))
        ttft = _paired_ttft(paired)
        if ttft:
            rows.append((f"serving c=16: {first} TTFT p50 below {second}", f"{ttft[0]:.0f} vs {ttft[1]:.0f} ms",
                         ttft[0] < ttft[1]))
    return rows


def _paired_ttft(paired: dict) -> tuple[float, float] | None:
    """Each engine's TTFT p50, the median over the paired rounds where both completed."""
    both = [entry["runs"] for entry in paired["rounds"] if entry.get("ratio") is not None]
    values = [[runs[name].get("p50_ttft_ms") for runs in both] for name in paired["engines"]]
    if not both or any(v is None for column in values for v in column):
        return None
    return statistics.median(values[0]), statistics.median(values[1])


def _at_concurrency(results: dict, name: str, concurrency: int) -> dict | None:
    """That engine's run at this concurrency, if it completed requests (a cut-short run
    whose every request failed has no throughput to compare)."""
    for r in results.get("serving", {}).get(name, []):
        if "error" not in r and r.get("max_concurrency") == concurrency and r.get("completed"):
            return r
    return None


def _median_round_ratio(row: dict, base: dict, key: str) -> float | None:
    """Median over rounds of row's figure / base's figure in the same round: engines in one
    round ran minutes apart, so a slow spell of the machine lands on both."""
    a, b = row.get("round_figures") or [], base.get("round_figures") or []
    if len(a) < 2 or len(a) != len(b):
        return None
    ratios = [x[key] / y[key] for x, y in zip(a, b) if x.get(key) and y.get(key)]
    return statistics.median(ratios) if ratios else None


def targets(results: dict) -> list[tuple[str, str, bool | None]]:
    """(target, measured ratio, met?) for each target of the issue that this run measured."""
    rows = []
    off = _offline_rows(results)

    def ratio(a, b):
        return None if a is None or b in (None, 0) else a / b

    base = off.get("llama.cpp f32", {}).get("decode_bs1_tok_s")
    for name, want in (("kiln f32", 1.0), ("kiln f16", 1.8)):
        r = ratio(off.get(name, {}).get("decode_bs1_tok_s"), base)
        if r is not None:
            per_round = _median_round_ratio(off[name], off["llama.cpp f32"], "decode_bs1_tok_s")
            spread = f" (best of each; median of per-round ratios {per_round:.2f}x)" if per_round is not None else ""
            rows.append((f"decode bs1: {name} ≥ {want}x llama.cpp f32", f"{r:.2f}x{spread}", r >= want))
    k, t = off.get("kiln f32", {}).get("prefill_512_ms"), off.get("transformers f32", {}).get("prefill_512_ms")
    if k and t:
        rows.append(("prefill 512: kiln f32 ≤ torch eager (transformers f32)", f"{k:.0f} vs {t:.0f} ms", k <= t))
    kiln16 = _at_concurrency(results, "kiln f32", 16)
    for peer, want in (("shortfin f32", 3.0), ("llama.cpp f32", 1.2)):
        other = _at_concurrency(results, peer, 16)
        target = f"serving c=16: kiln out tok/s ≥ {want}x {peer}"
        paired = next((p for p in paired_summaries(results) if p["engines"] == ["kiln f32", peer]), {})
        if paired.get("median_ratio"):
            # Paired rounds beat one sweep apart: quote their median.
            r = paired["median_ratio"]
            rows.append((target, f"{r:.2f}x (median of {paired['paired_rounds']} paired rounds)", r >= want))
        elif kiln16 and other:
            r = ratio(kiln16["output_throughput"], other["output_throughput"])
            rows.append((target, f"{r:.2f}x", r >= want))
        ttft = None
        if kiln16 and other and kiln16.get("p50_ttft_ms") and other.get("p50_ttft_ms"):
            ttft = kiln16["p50_ttft_ms"], other["p50_ttft_ms"]
        elif paired.get("median_ratio"):
            ttft = _paired_ttft(paired)  # no sweep in this run: the paired rounds' medians
        if ttft:
            rows.append((f"serving c=16: kiln TTFT p50 below {peer}", f"{ttft[0]:.0f} vs {ttft[1]:.0f} ms", ttft[0] < ttft[1]))
    prefix = results.get("prefix", {})
    if "trie" in prefix and "none" in prefix:
        r = ratio(prefix["none"]["p50_ttft_ms"], prefix["trie"]["p50_ttft_ms"])
        rows.append(("shared prefix: TTFT ≥ 3x better with the trie", f"{r:.2f}x", r >= 3.0))
    return rows + precision_targets(results)


def targets_table(results: dict) -> str:
    lines = ["| target | measured | met |", "|---|---|:-:|"]
    for target, measured, met in targets(results):
        lines.append(f"| {target} | {measured} | {'yes' if met else 'no'} |")
    return "\n".join(lines)


def _rounds_note(rows: list[dict]) -> str:
    rounds = max((r.get("rounds", 1) for r in rows), default=1)
    return f"; each figure the best of {rounds} rounds run in alternating engine order" if rounds > 1 else ""


def tables(results: dict) -> str:
    bw = results.get("membw")
    parts = [
        f"Measured {results.get('date', '?')} on {results.get('machine', {}).get('cpus', '?')} CPUs; "
        f"{results.get('model', '')}."
        + (f" Memory bandwidth (read, {bw['threads']} threads): {bw['read_gb_s']:.1f} GB/s." if bw else ""),
    ]
    if results.get("offline"):
        parts += ["", "Offline (batch 1 unless noted; decode after a 128-token prompt, 128 tokens"
                  + _rounds_note(results["offline"]) + "):", "", offline_table(results)]
    if results.get("serving"):
        parts += ["", "Serving (random 256-token prompts, 128 output tokens, ignore_eos, streaming):", "",
                  serving_table(results)]
        if any(name.startswith("shortfin") for name in results["serving"]):
            parts += ["", "shortfin answers /generate without streaming (its TTFT is the whole request) and "
                      "serves ~5 tokens/s here, so it gets one request per slot (at least 4) and no rate sweep."]
    if results.get("guidellm_check"):
        parts += ["", "Cross-check with guidellm 0.8.1 (same prompts, concurrency 16):", "",
                  "| engine | out tok/s | TTFT p50 (ms) | TPOT p50 (ms) |", "|---|---:|---:|---:|"]
        for name, r in results["guidellm_check"].items():
            parts.append(f"| {name} | {r['output_throughput']:.1f} | {_num(r.get('p50_ttft_ms'), '{:.0f}')} | "
                         f"{_num(r.get('p50_tpot_ms'))} |")
    if results.get("precision"):
        read_gb_s = results["precision"]["membw"]["read_gb_s"]
        parts += ["", "Weight precisions (`--quantize`), Kiln's compiled calls in paired rounds: a decode step at "
                  "128 tokens of context, a 512-token prefill; beside llama.cpp (llama-batched-bench, same "
                  "weights) as medians of per-round ratios, decode in tokens/s over 128 generated tokens, "
                  f"prefill as Kiln's time over llama.cpp's; floors at {read_gb_s:.1f} GB/s:", "",
                  precision_table(results["precision"])]
    if results.get("fixed_decode"):
        fixed = results["fixed_decode"]
        parts += ["", f"A decode step at {fixed['context']} tokens of context through its fixed-shape function "
                  "(its command buffer recorded once, at load) and through decode_bs<N> (recorded on every "
                  f"call), in one program: medians of {fixed['pairs']} alternating pairs, the speed-up the "
                  "median of the per-pair ratios:", "", fixed_decode_table(fixed)]
    for paired in paired_summaries(results):
        if paired.get("rounds"):
            parts += ["", f"Concurrency 16, {paired['engines'][0]} and {paired['engines'][1]} in alternating rounds "
                      "(same prompts within a round; each ratio pairs runs minutes apart):", "", paired_table(paired)]
    if results.get("prefix"):
        parts += ["", "Shared prefix (32 requests, 1024-token common prefix + 32 own tokens, 32 out, concurrency 4):",
                  "", prefix_table(results)]
    if results.get("kiln_on_shortfin_vmfb"):
        parts += ["", "Same artifact, two runtimes (shortfin's VMFB, one greedy 128-token request):", "",
                  runtimes_table(results["kiln_on_shortfin_vmfb"])]
    if targets(results):
        parts += ["", "Targets (ratios from this one run):", "", targets_table(results)]
    return "\n".join(parts)


RUNTIME_LABELS = {"kiln": "Kiln, its own environment", "kiln_iree39": "Kiln's code, IREE runtime 3.9"}


def runtimes_table(runs: dict) -> str:
    if "error" in runs:
        return f"failed: {runs['error'].strip().splitlines()[-1]}"
    lines = ["| runtime | IREE runtime | result | seconds |", "|---|---|---|---:|"]
    for label, r in runs.items():
        result = f"{r.get('completion_tokens')} tokens, {r.get('finish_reason')}" if r.get("ok") else r.get("error", "failed").rsplit(": ", 1)[-1]
        lines.append(f"| {RUNTIME_LABELS.get(label, label)} | {r.get('iree_runtime', '?')} | {result} | {_num(r.get('seconds'))} |")
    return "\n".join(lines)


def plot(results: dict, directory: Path) -> list[Path]:
    """Output tokens/s vs concurrency, and TTFT p50 vs request rate, one line per engine."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for key, x_label, y_key, y_label, filename in (
        ("max_concurrency", "max concurrency", "output_throughput", "output tokens/s", PLOTS["throughput"]),
        ("request_rate", "request rate (req/s, Poisson)", "p50_ttft_ms", "TTFT p50 (ms)", PLOTS["ttft"]),
    ):
        runs = _serving_runs(results, key)
        if not runs:
            continue
        fig, ax = plt.subplots(figsize=(6, 4), dpi=110)
        for name, picked in runs.items():
            ax.plot([r[key] for r in picked], [r[y_key] or 0 for r in picked], marker="o", label=name)
        ax.set_xlabel(x_label)
        ax.set_ylabel(y_label)
        if key == "max_concurrency":
            ax.set_xscale("log", base=2)
        else:
            ax.set_yscale("log")
        ax.set_title(f"SmolLM2-135M on {results.get('machine', {}).get('cpus', '?')} CPU cores")
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = directory / filename
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


def update_readme(readme: Path, body: str) -> None:
    text = readme.read_text()
    block = f"{BEGIN}\n{body}\n{END}"
    if BEGIN in text and END in text:
        text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, text, flags=re.S)
    else:
        text = text.rstrip("\n") + "\n\n## Results\n\n" + block + "\n"
    readme.write_text(text)


def write_all(results: dict, directory: Path, readme: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    images = plot(results, directory)
    rel = [p.relative_to(readme.parent) for p in images]
    body = tables(results) + ("\n\n" + "\n".join(f"![{p.stem}]({p.as_posix()})" for p in rel) if rel else "")
    update_readme(readme, body)


if __name__ == "__main__":
    path = Path(sys.argv[1])
    results = json.loads(path.read_text())
    write_all(results, README.parent / "results", README)
    print(tables(results))
