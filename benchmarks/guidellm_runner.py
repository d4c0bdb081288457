"""Drive an OpenAI-compatible server with guidellm 0.8.1 and report loadgen's metric dict.

The issue asks for a well-kept load generator where it fits; guidellm speaks /v1/completions,
streams, and sends `ignore_eos` with `max_tokens` when a row gives its output length. It lives
in its own venv (`<cache>/peers/guidellm`: it pulls torch, transformers and datasets), never in
Kiln's, and runs offline: the prompts are our workload's, written to a JSONL file (so both
tools and every engine see the same text), and its tokenizer is the model's local directory.

How its report maps (checked on a real report; where it cannot match, None, not a look-alike):
- its `inter_token_latency_ms` is each request's (last token - first token) / (tokens - 1),
  counted once per gap. That is vLLM's TPOT per request; with `ignore_eos` every request has
  the same length, so the gap weighting changes nothing and it gives `*_tpot_ms`. Its mean is
  also the mean of all gaps pooled, vLLM's mean ITL (`mean_itl_ms`); the ITL percentiles need
  each gap, which guidellm does not keep: `p50/p90/p99_itl_ms` are None.
- its request latency ends when the response ends (after the usage chunk), ours at the last
  text chunk: a fraction of a millisecond apart.
- its percentiles come from a step CDF, not numpy's linear interpolation (close, not equal).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import loadgen

REQUIREMENTS = ["guidellm==0.8.1", "torch==2.13.0"]  # torch pinned: a looser spec pulls CUDA wheels
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "GUIDELLM__LOGGING__CONSOLE_LOG_LEVEL": "WARNING"}


def guidellm_python() -> Path:
    """guidellm's venv, made once (under the heavy lock) by the peers' helper."""
    from benchmarks.peers.common import make_venv

    return make_venv("guidellm", REQUIREMENTS)


def write_dataset(workload: loadgen.Workload, path: Path) -> Path:
    """One JSON line per request: guidellm's column mapper reads `prompt`, `prompt_tokens_count`
    and `output_tokens_count` (the last makes it send max_tokens and ignore_eos)."""
    with open(path, "w") as f:
        for prompt, n in zip(workload.prompts, workload.prompt_lens):
            f.write(json.dumps({"prompt": prompt, "prompt_tokens_count": n,
                                "output_tokens_count": workload.output_len}) + "\n")
    return path


def profile(rate: float | None, concurrency: int | None) -> dict:
    """Our load shapes in guidellm's terms: Poisson at a rate (optionally capped), a fixed
    number of streams, or everything at once (`throughput`)."""
    if rate is not None:
        shape = {"kind": "poisson", "rate": [rate]}
        return shape | ({"max_concurrency": concurrency} if concurrency else {})
    if concurrency is not None:
        return {"kind": "concurrent", "streams": [concurrency]}
    return {"kind": "throughput"}


def command(python: Path, base_url: str, model: str | None, workload: loadgen.Workload, data: Path,
            out: Path, rate: float | None, concurrency: int | None, seed: int) -> list[str]:
    backend = {"kind": "openai_http", "target": base_url, "request_format": "/v1/completions",
               "http2": False, "extras": {"body": {"temperature": 0}}}
    if model:
        backend["model"] = model
    tokenizer_dir = Path(workload.tokenizer_path)
    tokenizer_dir = tokenizer_dir if tokenizer_dir.is_dir() else tokenizer_dir.parent
    return [str(python), "-m", "guidellm", "run",
            "--backend", json.dumps(backend),
            "--tokenizer", json.dumps({"kind": "hf_auto", "model": str(tokenizer_dir)}),
            "--profile", json.dumps(profile(rate, concurrency)),
            "--constraint", json.dumps({"kind": "max_requests", "count": len(workload)}),
            "--data", json.dumps({"kind": "json_file", "path": str(data)}),
            "--seed", json.dumps({"kind": "static", "value": seed}),
            "--output", json.dumps({"kind": "json", "path": str(out)}),
            "--disable-progress"]


def _dist(metrics: dict, name: str, status: str = "successful") -> dict | None:
    summary = (metrics.get(name) or {}).get(status)
    return summary if summary and summary.get("count") else None


def _stats(summary: dict | None, series: str) -> dict:
    if summary is None:
        return {f"{stat}_{series}_ms": None for stat in loadgen.STATS}
    p = summary["percentiles"]
    return {f"mean_{series}_ms": summary["mean"], f"p50_{series}_ms": p["p50"],
            f"p90_{series}_ms": p["p90"], f"p99_{series}_ms": p["p99"]}


def metrics_from_report(report: dict, *, workload: str, rate: float | None,
                        concurrency: int | None) -> dict:
    """The first (only) benchmark of a guidellm JSON report as loadgen's metric dict."""
    bench = report["benchmarks"][0]
    m = bench["metrics"]
    totals = m["request_totals"]
    completed, failed = totals["successful"], totals["errored"] + totals["incomplete"]
    duration = bench["duration"]
    tokens_in = (_dist(m, "prompt_token_count") or {}).get("total_sum", 0)
    tokens_out = (_dist(m, "output_token_count") or {}).get("total_sum", 0)
    latency_ms = _dist(m, "request_latency")
    if latency_ms is not None:  # guidellm keeps request latency in seconds
        latency_ms = {"mean": latency_ms["mean"] * 1000,
                      "percentiles": {k: v * 1000 for k, v in latency_ms["percentiles"].items()}}
    tpot = _dist(m, "inter_token_latency_ms")
    itl = _stats(None, "itl") | ({"mean_itl_ms": tpot["mean"]} if tpot else {})
    errors = []
    for r in (bench.get("requests") or {}).get("errored") or []:
        text = str((r.get("info") or {}).get("error") or r.get("error") or "error")
        if text not in errors and len(errors) < 5:
            errors.append(text)
    per_s = (lambda x: x / duration) if duration else (lambda x: 0.0)
    metrics = {
        "tool": "guidellm", "backend": "openai", "workload": workload,
        "request_rate": rate, "max_concurrency": concurrency, "num_requests": completed + failed,
        "completed": completed, "failed": failed, "duration_s": duration,
        "total_input_tokens": int(tokens_in), "total_output_tokens": int(tokens_out),
        "request_throughput": per_s(completed), "output_throughput": per_s(tokens_out),
        "total_token_throughput": per_s(tokens_in + tokens_out),
        **_stats(_dist(m, "time_to_first_token_ms"), "ttft"),
        **_stats(tpot, "tpot"),
        **itl,
        **_stats(latency_ms, "e2el"),
        "ttft_is_e2e": False,
        "errors": errors,
    }
    return {key: metrics[key] for key in loadgen.METRIC_KEYS}


def run(base_url: str, workload: loadgen.Workload, rate: float | None = None, concurrency: int | None = None,
        seed: int = 0, model: str | None = None, timeout: float = 3600) -> dict:
    """One guidellm benchmark of `workload` against `base_url`, after our own warm-up request."""
    import asyncio

    import httpx

    python = guidellm_python()
    backend = loadgen.OpenAIBackend(base_url, model)

    async def warm_up() -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0)) as client:
            await backend.prepare(client)
            result = await backend.send(client, workload.warmup_prompt, min(workload.output_len, 16))
            if not result.ok:
                raise RuntimeError(f"the warm-up request failed: {result.error}")

    asyncio.run(warm_up())
    with tempfile.TemporaryDirectory(prefix="kiln-guidellm-") as tmp:
        data, out = write_dataset(workload, Path(tmp) / "prompts.jsonl"), Path(tmp) / "report.json"
        args = command(python, base_url, backend.model, workload, data, out, rate, concurrency, seed)
        started = time.monotonic()
        done = subprocess.run(args, env={**os.environ, **OFFLINE}, capture_output=True, text=True,
                              timeout=timeout, cwd=tmp)
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"guidellm failed ({done.returncode}) after {time.monotonic() - started:.0f} s:\n"
                               f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
        report = json.loads(out.read_text())
    return metrics_from_report(report, workload=workload.kind, rate=rate, concurrency=concurrency)


def main(argv: list[str] | None = None) -> int:
    """loadgen's command line, the load driven by guidellm (OpenAI targets only)."""
    args = loadgen.arguments("python -m benchmarks.guidellm_runner", __doc__.split("\n\n")[0]).parse_args(argv)
    if args.backend != "openai":
        raise SystemExit("guidellm drives OpenAI-compatible servers only (--backend openai)")
    metrics = run(args.base_url, loadgen.workload_of(args), args.rate, args.concurrency, args.seed, args.model)
    return loadgen.report(args, metrics, [])


if __name__ == "__main__":
    sys.exit(main())
