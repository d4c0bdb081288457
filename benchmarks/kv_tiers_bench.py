"""The prefix cache's host and disk tiers on SmolLM2-135M (float32), this machine's cores.

    python -m benchmarks.kv_tiers_bench

1. Multi-turn: 8 conversations (a 256-token system prompt of their own, then turns of 64
   user tokens and 32 generated ones, 4 turns each, the conversations taking turns, 2 at a
   time) against a device cache that holds about three of them: TTFT p50/p90 and the prompt
   tokens prefilled (the usage's), with the host tier off (pages evicted are recomputed),
   write-through and write-back. On the CPU the device's cache is host memory, so a copy
   back is a memcpy: what the tier gains is the prefill it saves.
2. Restart: a 1,000-token prompt on a fresh server, then again after a restart, with the
   disk tier (--kv-cache-dir) and without: the restarted server's TTFT and tokens prefilled.

Every run's greedy text is checked against the tier-off run's. Figures, not asserts; the
JSON goes to benchmarks/results/kv-tiers-<date>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import sys
import tempfile
from pathlib import Path

from benchmarks.kiln_offline import build_artifacts
from benchmarks.peers.common import heavy_lock, log
from benchmarks.replicas_bench import RESULTS_DIR, kiln, stream_completions, usage_summary

CONVERSATIONS, TURNS, SYSTEM_TOKENS, USER_TOKENS, OUTPUT_TOKENS = 8, 4, 256, 64, 32
DEVICE_PAGES = 120  # about three conversations at their longest (40 pages each)
HOST_SIZE = "1GiB"
RESTART_PROMPT_TOKENS = 1000
TIERS = {"host tier off": (), "write-through": ("--host-kv-size", HOST_SIZE),
         "write-back": ("--host-kv-size", HOST_SIZE, "--host-kv-write-policy", "write_back")}


def _tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(300, 40000) for _ in range(count)]


def multi_turn(url: str) -> list[dict]:
    """The conversations' turns, two conversations at a time, each turn's prompt the whole history."""
    rng = random.Random(5)
    histories = [_tokens(rng, SYSTEM_TOKENS) for _ in range(CONVERSATIONS)]
    results = []
    for _ in range(TURNS):
        for pair in range(0, CONVERSATIONS, 2):
            for history in histories[pair:pair + 2]:
                history += _tokens(rng, USER_TOKENS)
            replies = asyncio.run(stream_completions(url, [list(h) for h in histories[pair:pair + 2]], 2,
                                                     max_tokens=OUTPUT_TOKENS))
            for history, reply in zip(histories[pair:pair + 2], replies):
                history += _tokens(random.Random(reply["text"]), OUTPUT_TOKENS)  # the reply, as ids of its own
            results += replies
    return results


def step_multi_turn(artifacts: Path) -> dict:
    out, reference = {}, None
    for name, options in TIERS.items():
        log(f"multi-turn: {name}")
        with kiln(artifacts, "--kv-cache-pages", str(DEVICE_PAGES), *options) as url:
            results = multi_turn(url)
        texts = [r["text"] for r in results]
        reference = reference or texts
        out[name] = {**usage_summary(results), "same_text_as_tier_off": texts == reference}
        out[name].pop("requests_per_replica", None)
        log(f"  hit rate {out[name]['prefix_hit_rate']:.1%}, prefilled {out[name]['prefill_tokens_computed']} tokens, "
            f"TTFT p50 {out[name]['ttft_p50_ms']:.0f} ms, p90 {out[name]['ttft_p90_ms']:.0f} ms")
    return out


def step_restart(artifacts: Path) -> dict:
    prompt = _tokens(random.Random(9), RESTART_PROMPT_TOKENS)
    out = {}
    for name, with_disk in (("without the disk tier", False), ("with the disk tier", True)):
        with tempfile.TemporaryDirectory() as directory:
            options = ("--kv-cache-dir", directory) if with_disk else ()
            runs = []
            for _ in range(2):  # a first server, then a restarted one on the same directory
                with kiln(artifacts, *options) as url:
                    runs.append(asyncio.run(stream_completions(url, [prompt], 1, max_tokens=8))[0])
        first, restarted = runs
        out[name] = {"first_ttft_ms": first["ttft_ms"], "restarted_ttft_ms": restarted["ttft_ms"],
                     "restarted_prefill_tokens": restarted["prompt_tokens"] - restarted["cached_tokens"],
                     "same_text": first["text"] == restarted["text"]}
        log(f"restart {name}: TTFT {first['ttft_ms']:.0f} ms, then {restarted['ttft_ms']:.0f} ms after a restart "
            f"({out[name]['restarted_prefill_tokens']} tokens prefilled)")
    return out


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    artifacts = build_artifacts("float32")
    results = {"measured": datetime.datetime.now().isoformat(timespec="seconds"), "machine": platform.machine(),
               "cpus": os.cpu_count(), "model": "SmolLM2-135M-Instruct float32"}
    with heavy_lock():
        results["multi_turn"] = step_multi_turn(artifacts)
        results["restart"] = step_restart(artifacts)
    RESULTS_DIR.mkdir(exist_ok=True)
    path = RESULTS_DIR / f"kv-tiers-{datetime.date.today().isoformat()}.json"
    path.write_text(json.dumps(results, indent=1))
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
