"""The KV cache a long conversation holds on a model with sliding-window layers: the sliding layers'
pages let go as blocks leave their window (runtime/kvcache/window_pool.py), against a cache that
keeps every page.

    python -m benchmarks.window_bench [--model gemma-3-270m] [--context 8192] [--turn 480] [--reply 32]
                                      [--json OUT]

The model is built as `kiln serve --model` builds it, its context `--context`. Then, in a fresh
process for each cache, one conversation grows to `--context` tokens: each turn sends the whole
conversation so far plus `--turn` new tokens (as a chat client does; the prefix cache serves what it
has) and takes `--reply` greedy tokens. The cache that keeps every page is the same build served with a small host KV tier, under
which the runtime keeps every group's page (a host tier copies blocks whole). After every step the
conversation's own pages are counted: its global groups' pages for each block, and its sliding
groups' for the blocks it still watches; the prefix cache's further pages (sliding pages kept while
the room is not wanted, taken back first when it is) are reported apart. The window pages run again
in a cache of a quarter of the memory: the conversation still fits, at the cost of what the prefix
cache can keep.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

MiB = 2**20


def measure(artifacts: Path, context: int, turn: int, reply: int, keep_every_page: bool, fraction: float) -> dict:
    """In this process: the conversation, and the pages it held after each step."""
    import numpy as np

    from kiln.runtime import LLM, SamplingParams
    from kiln.runtime.config import load_model_config
    from kiln.runtime.kvcache.window_pool import WindowPagePool

    params, _ = load_model_config(Path(artifacts) / "model.json")
    options = {"page_count": int(-(-context // params.block_seq_stride) * fraction) + 8}
    if keep_every_page:  # a host tier of two blocks (a page of every layer each)
        options["host_kv_bytes"] = 2 * params.page_bytes
    with LLM(artifacts, "cpu", **options) as llm:
        service = llm.service
        pool, cache, program = service.pool, service.cache, service.program
        assert isinstance(pool, WindowPagePool), "the model's pages are not laid out by groups"
        assert pool.release_windows is not keep_every_page
        groups = pool.groups
        sliding, global_groups = sum(groups.sliding), groups.count - sum(groups.sliding)
        page_mib = program.page_elems * program.cache_dtype.itemsize / MiB
        steps = []
        advance = cache.advance

        def counted(allocation, computed):
            advance(allocation, computed)
            blocks = len(allocation.pages)
            watched = allocation.window_end - allocation.window_start if pool.release_windows else blocks
            in_use = pool.physical.total - pool.physical.free_count
            own = blocks * global_groups + watched * sliding
            steps.append({"tokens": computed, "own_pages": own, "other_pages": in_use - own})

        cache.advance = counted
        rng = np.random.default_rng(0)
        history: list[int] = []
        greedy = SamplingParams(max_tokens=reply, temperature=0, ignore_eos=True)
        while len(history) + turn + reply <= context:
            history += rng.integers(1000, service.vocab_size - 1, turn).tolist()
            [result] = llm.generate([history], greedy)
            history += list(result.completions[0].token_ids)
        last = steps[-1]
        return {
            "artifacts": str(artifacts), "cache": "keeps every page" if keep_every_page else "window pages",
            "cache_fraction": fraction,
            "context_tokens": len(history), "page_groups": groups.to_json(), "page_mib": page_mib,
            "own_mib_at_end": last["own_pages"] * page_mib,
            "own_mib_peak": max(s["own_pages"] for s in steps) * page_mib,
            "prefix_cache_mib_at_end": last["other_pages"] * page_mib,
            "whole_cache_mib": pool.physical.total * page_mib,
            "prefix_hit_tokens": service.stats().prefix_hit_tokens,
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("gemma-3-270m"),
                        help="a model with sliding-window layers: a file, a directory or a packaged model's name")
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--turn", type=int, default=480, help="new prompt tokens each turn")
    parser.add_argument("--reply", type=int, default=32, help="greedy tokens each turn")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)  # the child's job
    parser.add_argument("--keep-every-page", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cache-fraction", type=float, default=1.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.context, args.turn, args.reply, args.keep_every_page,
                                 args.cache_fraction)))
        return 0
    from benchmarks.kiln_offline import build_in_child
    from kiln.models.packaged import resolve_model_path

    # `kiln serve --model`'s build, with the context the conversation reaches.
    artifacts = build_in_child(f"replace(default_build_options(), max_seq_len={args.context})",
                               model=resolve_model_path(args.model))
    rows = []
    # Each cache with the memory of the whole conversation's blocks held whole; the window pages also
    # with a quarter of that, which a cache keeping every page could not serve the conversation from.
    for keep, fraction in ((False, 1.0), (True, 1.0), (False, 0.25)):
        command = [sys.executable, "-m", "benchmarks.window_bench", "--measure", str(artifacts),
                   "--context", str(args.context), "--turn", str(args.turn), "--reply", str(args.reply),
                   "--cache-fraction", str(fraction), *(["--keep-every-page"] if keep else [])]
        done = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parent.parent)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"{args.model}, a conversation of {rows[0]['context_tokens']:,} tokens in turns of {args.turn} + "
          f"{args.reply}, page groups {rows[0]['page_groups']['layers']}")
    print("| cache | its size | the conversation's pages at the end | their peak | the prefix cache's further "
          "pages | prefix hits |")
    print("|---|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['cache']} | {row['whole_cache_mib']:,.1f} MiB | {row['own_mib_at_end']:,.1f} MiB "
              f"| {row['own_mib_peak']:,.1f} MiB | {row['prefix_cache_mib_at_end']:,.1f} MiB "
              f"| {row['prefix_hit_tokens']:,} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
