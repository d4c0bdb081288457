"""Tracing at a fraction of torch.export's usual cost: each function traced once, straight to
functional ATen, with no Python stack recorded per node.

iree-turbine's `export_program` calls `torch.export.export`, which traces to the pre-dispatch
("training") IR; turbine then runs its decomposition table over the program, and that step
traces the whole graph a second time to functionalize it. Tracing with `pre_dispatch=False`
gives the functional ATen graph at once, as torch.export did before its training IR, with the
composite ops the table leaves alone (`linear`, `matmul`) kept whole as the second pass keeps
them: the same MLIR, less the shape asserts. The table's decompositions run only where the graph
holds an op they would rewrite and the MLIR import cannot take as it is, which for Kiln's models
is never. And torch.fx records the Python stack of every node it creates (SmolLM2's prefill
makes 52,000), which only reaches the MLIR as source locations: not recorded here.
SmolLM2's default build, prefill at batch 4: 59 s, 41 s in one pass, 24 s without the stacks;
decode at batch 4: 22, 10, 7 s (benchmarks/NOTES.md, "Build time").

That one pass still runs the model twice. AOT autograd first runs it on fake tensors to learn
which inputs the call mutates and which outputs alias what (its "metadata" pass), then again to
record the graph. What the first run learns is the function's signature, and a paged model's is
the same with one layer as with thirty: the cache written in place, the logits or hidden states
returned, every weight only read. So the first run goes through the first layer alone
(`PagedLlama.first_layer_only`): a fifth of a trace's time saved, and the same program.

The MLIR import then asks Python for the module of the torch dialect's op classes for every op and
type it makes (`iree.compiler.dialects.torch`, `.torch_c`). IREE ships none, and MLIR remembers a
module it found but not one it did not: 55,000 failed imports for one decode function, each a walk
of the import path. `answer_dialect_lookups` puts an empty module under those names, which MLIR
finds and remembers (an empty module means what a missing one does: the ops' generic form).

`torch.export._trace._export` and the composite-op override are torch's own, below
`torch.export.export` and `run_decompositions`; torch is pinned (pyproject.toml), and where they
are missing the usual two passes run.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types

import torch
import torch.fx.config
from iree.turbine.aot.decompositions import current_aot_decompositions, extend_aot_decompositions

try:
    from torch.export._trace import _export as _export_to_aten
    from torch.export.exported_program import (
        _override_composite_implicit_decomp, _split_decomp_table_to_cia_and_python_decomp,
    )
except ImportError:  # another torch: trace as turbine does
    _export_to_aten = None
try:
    import torch._functorch.aot_autograd as _aot_autograd

    _collect_metadata = _aot_autograd.run_functionalized_fw_and_collect_metadata
except (ImportError, AttributeError):  # another torch: the metadata pass runs every layer
    _collect_metadata = None

# Ops in turbine's table that torch-mlir's import lowers itself (a dtype copy, a 2-D transpose):
# decomposing them first would cost the second trace and change nothing.
IMPORTED_AS_THEY_ARE = {torch.ops.aten._to_copy.default, torch.ops.aten.t.default}


def _ops(program) -> set:
    return {node.target for node in program.graph.nodes if node.op == "call_function"}


@contextlib.contextmanager
def _without_stack_traces():
    recorded = torch.fx.config.do_not_emit_stack_traces
    torch.fx.config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        torch.fx.config.do_not_emit_stack_traces = recorded


@contextlib.contextmanager
def _metadata_from_first_layer(model):
    """Within it, AOT autograd's metadata pass runs `model` (a PagedLlama) on its first layer."""
    if _collect_metadata is None or not hasattr(model, "first_layer_only"):
        yield
        return

    def collect_on_first_layer(function, **options):
        collect = _collect_metadata(function, **options)

        def collect_metadata(*args):
            with model.first_layer_only():
                return collect(*args)

        return collect_metadata

    _aot_autograd.run_functionalized_fw_and_collect_metadata = collect_on_first_layer
    try:
        yield
    finally:
        _aot_autograd.run_functionalized_fw_and_collect_metadata = _collect_metadata


@contextlib.contextmanager
def fast_tracing(model=None):
    """Within it, turbine's `export_program` traces each function once, recording no stacks; and
    where `model` runs its first layer alone on request (PagedLlama), the metadata pass runs so."""
    if _export_to_aten is None:
        with _without_stack_traces():
            yield
        return
    table = current_aot_decompositions()
    two_passes = torch.export.export

    def one_pass(module, args, kwargs=None, *, dynamic_shapes=None, strict=False, **options):
        if options:  # an option this path does not know: the usual export
            return two_passes(module, args, kwargs, dynamic_shapes=dynamic_shapes, strict=strict, **options)
        composite, _ = _split_decomp_table_to_cia_and_python_decomp(dict(table))
        with _override_composite_implicit_decomp(composite):
            program = _export_to_aten(module, args, kwargs, dynamic_shapes, strict=strict, pre_dispatch=False)
        needed = {op: rule for op, rule in table.items() if op in _ops(program) - IMPORTED_AS_THEY_ARE}
        return program.run_decompositions(needed) if needed else program

    torch.export.export = one_pass
    try:
        # Turbine's own pass after the export: nothing left for it to do.
        with _without_stack_traces(), extend_aot_decompositions(from_current=False), \
                _metadata_from_first_layer(model):
            yield
    finally:
        torch.export.export = two_passes


# The dialects the import makes ops of that have no op classes in iree.compiler.
_DIALECTS_WITHOUT_MODULES = ("iree.compiler.dialects.torch", "iree.compiler.dialects.torch_c")


def answer_dialect_lookups() -> None:
    """An empty module for each dialect the MLIR import looks for in vain (above); one that exists
    is left as it is."""
    for name in _DIALECTS_WITHOUT_MODULES:
        if name in sys.modules:
            continue
        try:
            importlib.import_module(name)
        except ImportError:
            sys.modules[name] = types.ModuleType(name, "No op classes: MLIR builds this dialect's ops in their "
                                                       "generic form (export/fast_trace.py).")
