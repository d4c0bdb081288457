"""benchmarks/memory_bench.py on the tiny build: its own process, the cache's bytes taken out, the
table and the JSON written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e


def test_resident_memory_is_reported_against_parameters_and_cache(tiny_artifacts, tmp_path):
    out = tmp_path / "memory.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.memory_bench", str(tiny_artifacts), "--pages", "32",
                           "--json", str(out)], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    assert f"| {tiny_artifacts.name} |" in done.stdout
    (row,) = json.loads(out.read_text())
    assert row["parameters_mib"] == pytest.approx((tiny_artifacts / "model.irpa").stat().st_size / 2**20)
    assert row["kv_cache_mib"] == 32 * 2 * 2 * 2 * 16 * 16 * 4 / 2**20  # pages x layers x (k, v) x heads x stride x dim
    assert 0 < row["after_load"]["VmRSS"] <= row["after_calls"]["VmRSS"]
    assert row["target_mib"] == pytest.approx(1.15 * row["parameters_mib"] + 300)
