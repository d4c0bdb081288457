"""benchmarks/lora_bench.py's adapters are ones the server reads: PEFT's format, the build's shapes."""

from __future__ import annotations

from types import SimpleNamespace

from benchmarks.lora_bench import RANK, write_adapters
from kiln.runtime.lora.adapter import LoraShapes, read_adapter


def test_the_benchmarks_adapters_fit_the_build(tmp_path):
    abi = SimpleNamespace(lora_layers=2, lora_modules=(("q_proj", 64, 64), ("down_proj", 128, 64)))
    made = write_adapters(tmp_path, abi, 3)
    shapes = LoraShapes(2, RANK, {"q_proj": (64, 64), "down_proj": (128, 64)})
    for name, path in made.items():
        adapter = read_adapter(name, path, shapes)
        assert adapter.rank == RANK and adapter.modules == {"q_proj", "down_proj"}
