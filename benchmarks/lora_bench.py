"""What serving LoRA adapters costs a decode step: the bundled SmolLM2 (Q4_1, as `kiln serve`
builds it) with 8 adapter slots of rank 16 over every projection, beside the same build without
slots.

    python -m benchmarks.lora_bench [--rounds 3] [--output FILE]

Decode tokens/s at batch 8 (8 prompts of 128 tokens, 64 tokens each, greedy, the prefill's step
left out as kiln_offline does): the build without slots; the build with slots and no adapter; all
8 rows with one adapter; 4 adapters (2 rows each); 8 adapters (one each). Random rank-16 adapters in
PEFT's format. Rounds alternate the order of the cases; the ratios to the slot-less build are what
to quote. Results go to results/lora-<date>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import numpy as np

from benchmarks.kiln_offline import build_in_child

SLOTS, RANK, BATCH, PROMPT, TOKENS = 8, 16, 8, 128, 64
CASES = {"no slots": None, "slots, no adapter": [None] * BATCH, "1 adapter": ["a0"] * BATCH,
         "4 adapters": [f"a{i // 2}" for i in range(BATCH)], "8 adapters": [f"a{i}" for i in range(BATCH)]}


def write_adapters(directory: Path, abi, count: int) -> dict[str, str]:
    """`count` random rank-RANK adapters over every module the build adapts, in PEFT's format."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    made = {}
    for index in range(count):
        tensors = {}
        for layer in range(abi.lora_layers):
            for module, fin, fout in abi.lora_modules:
                block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
                key = f"base_model.model.model.layers.{layer}.{block}.{module}"
                tensors[f"{key}.lora_A.weight"] = (rng.normal(size=(RANK, fin)) * 0.01).astype(np.float32)
                tensors[f"{key}.lora_B.weight"] = (rng.normal(size=(fout, RANK)) * 0.01).astype(np.float32)
        path = directory / f"a{index}"
        path.mkdir(parents=True)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": RANK, "lora_alpha": RANK}))
        made[f"a{index}"] = str(path)
    return made


def measure(artifacts: Path, adapters: list[str | None] | None, rounds: int) -> float:
    """Median decode tokens/s at batch BATCH, each row with its adapter (in this process: no torch)."""
    from dataclasses import replace

    from kiln.runtime import LLM, SamplingParams
    from kiln.runtime.contract import Artifacts
    from kiln.runtime.program import Program

    with tempfile.TemporaryDirectory() as scratch:
        names = {}
        if adapters is not None:
            abi = Program(Artifacts.in_directory(artifacts), "local-task", "auto").capabilities
            names = write_adapters(Path(scratch), abi, len({a for a in adapters if a}))
        rng = np.random.default_rng(1)
        prompts = [rng.integers(100, 30000, PROMPT).tolist() for _ in range(BATCH)]
        with LLM(artifacts, prefix_sharing="none", lora_adapters=names) as llm:
            base = SamplingParams(temperature=0, ignore_eos=True)

            def timed(max_tokens: int) -> float:
                started = time.perf_counter()
                llm.generate(prompts, [replace(base, max_tokens=max_tokens, lora=name)
                                       for name in (adapters or [None] * BATCH)])
                return time.perf_counter() - started

            timed(2)
            steps = [timed(TOKENS) - timed(1) for _ in range(rounds)]
    return BATCH * (TOKENS - 1) / statistics.median(steps)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", type=Path)
    parser.add_argument("--measure", nargs=3, help=argparse.SUPPRESS)  # artifacts, case, rounds: a child's part
    args = parser.parse_args()
    if args.measure:
        artifacts, case, rounds = args.measure
        print(json.dumps({"tok_s": measure(Path(artifacts), CASES[case], int(rounds))}))
        return 0
    plain = build_in_child("default_build_options()")
    with_slots = build_in_child(f"replace(default_build_options(), lora_slots={SLOTS}, lora_rank={RANK})")
    here = Path(__file__).resolve().parent.parent
    figures: dict[str, list[float]] = {case: [] for case in CASES}
    for index in range(args.rounds):
        order = list(CASES) if index % 2 == 0 else list(CASES)[::-1]
        for case in order:
            artifacts = plain if CASES[case] is None else with_slots
            done = subprocess.run([sys.executable, "-m", "benchmarks.lora_bench", "--measure", str(artifacts), case,
                                   "1"], check=True, stdout=subprocess.PIPE, text=True, cwd=here)
            figures[case].append(json.loads(done.stdout.strip().splitlines()[-1])["tok_s"])
    base = statistics.median(figures["no slots"])
    result = {"batch": BATCH, "prompt": PROMPT, "tokens": TOKENS, "slots": SLOTS, "rank": RANK,
              "cases": {case: {"decode_tok_s": [round(v, 1) for v in values],
                               "ratio_to_no_slots": round(statistics.median(values) / base, 3)}
                        for case, values in figures.items()}}
    output = args.output or Path(__file__).parent / "results" / f"lora-{date.today().isoformat()}.json"
    output.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
