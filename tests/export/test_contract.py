"""What the exporter writes is what the runtime expects: one contract (runtime/contract.py)."""

from __future__ import annotations

import inspect
import re

import pytest

from kiln.export.exporter import abi_functions
from kiln.export.options import ExportOptions
from kiln.runtime.config import load_model_config, sidecar_path
from kiln.runtime.contract import (
    CONFIG_FILE, MLIR_FILE, PARAMETER_SCOPE, PARAMETERS_FILE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, Artifacts,
    FunctionKind, argument_names, expected_functions, fixed_decode_context, fixed_decode_name, parse_function_name,
    vmfb_file,
)
from kiln.runtime.program import Program

_SIGNATURE = re.compile(r"func\.func @(\w+)\((.*?)\) -> ")
_ARGUMENT = re.compile(r"%arg\d+: !torch\.v?tensor<\[([^\]]*)\],(\w+)>")


@pytest.mark.parametrize("has_prefill_position", [True, False])
def test_the_traced_functions_take_the_contracts_arguments_in_order(has_prefill_position):
    options = ExportOptions(has_prefill_position=has_prefill_position)
    for kind, body in abi_functions(options, final_only=False).items():
        parameters = [p for p in inspect.signature(body).parameters if p not in ("model", "final_only")]
        assert tuple(parameters) == argument_names(kind, has_prefill_position)


def test_function_names_round_trip():
    for kind in FunctionKind:
        assert parse_function_name(f"{kind.value}_bs12") == (kind, 12)
    assert parse_function_name("prefill_bs0") is None and parse_function_name("main") is None
    assert parse_function_name(fixed_decode_name(4, 512)) == (FunctionKind.DECODE, 4)
    assert fixed_decode_context("decode_bs4_ctx512") == 512 and fixed_decode_context("decode_bs4") is None
    assert parse_function_name("prefill_bs4_ctx512") is None


def signatures(mlir_text: str) -> dict[str, list[tuple[str, str]]]:
    """Each public function's arguments as (shape, element type), read off the MLIR."""
    return {name: _ARGUMENT.findall(arguments) for name, arguments in _SIGNATURE.findall(mlir_text)}


@pytest.mark.e2e
def test_the_export_writes_what_the_runtime_loads(tiny_artifacts):
    params, kiln = load_model_config(tiny_artifacts / CONFIG_FILE)
    expected = expected_functions(params, with_prefill_last=True)
    written = {path.name for path in tiny_artifacts.iterdir()}
    assert written == {MLIR_FILE, PARAMETERS_FILE, CONFIG_FILE, sidecar_path(tiny_artifacts / CONFIG_FILE).name,
                       TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, vmfb_file("cpu")}

    mlir = (tiny_artifacts / MLIR_FILE).read_text()
    assert f'#flow.parameter.named<"{PARAMETER_SCOPE}"::' in mlir
    functions = signatures(mlir)
    assert sorted(functions) == sorted(expected)
    page_elems = str(params.page_elems)
    for name, arguments in functions.items():
        kind, batch_size = parse_function_name(name)
        traced = FunctionKind.DECODE if kind is FunctionKind.DECODE else FunctionKind.PREFILL
        names = argument_names(traced, params.has_prefill_position)
        assert len(arguments) == len(names), name
        shapes = dict(zip(names, arguments))
        assert shapes["tokens"] == ((f"{batch_size},1" if kind is FunctionKind.DECODE else f"{batch_size},?"), "si64")
        assert shapes["seq_lens"] == (str(batch_size), "si64")
        assert shapes["seq_block_ids"] == (f"{batch_size},?", "si64")
        assert shapes["cache"] == (f"?,{page_elems}", "f32")

    program = Program(Artifacts.in_directory(tiny_artifacts))
    assert sorted(program.functions) == sorted(expected)
    abi = program.capabilities
    assert abi.prefill_batch_sizes == tuple(params.prefill_batch_sizes) == abi.prefill_last_batch_sizes
    assert abi.decode_batch_sizes == tuple(params.decode_batch_sizes)
    assert abi.has_prefill_position and not abi.prefill_returns_last_only
    assert abi.prefill_function(4, every_position=False) == ("prefill_last_bs4", True)
    assert abi.prefill_function(4, every_position=True) == ("prefill_bs4", False)
