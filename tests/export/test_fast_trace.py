"""export/fast_trace.py: a function traced once (no second, decomposing trace), to the same
operations the usual two passes give, with no Python stacks recorded; the export's MLIR the same
but for the shape asserts the single pass leaves out."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path
from collections import Counter

import pytest
import torch
from iree.turbine import aot
from torch.export import Dim

from kiln.export.fast_trace import fast_tracing


class Cached(torch.nn.Module):
    """A linear layer, a matmul and an in-place write to a cache argument, as the models do."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x, cache):
        h = self.proj(x)
        cache[: h.shape[0]] = h.to(cache.dtype)
        return torch.matmul(h, h.transpose(0, 1)).softmax(-1)


def export(fast: bool, monkeypatch) -> tuple[aot.ExportOutput, list, int]:
    decompositions = []
    run = torch.export.ExportedProgram.run_decompositions
    monkeypatch.setattr(torch.export.ExportedProgram, "run_decompositions",
                        lambda self, *args, **kwargs: decompositions.append(1) or run(self, *args, **kwargs))
    model = Cached()
    fxb = aot.FxProgramsBuilder(model)
    rows = Dim("rows", min=2, max=64)
    with torch.no_grad(), (fast_tracing() if fast else torch.no_grad()):
        program = fxb.export_program(lambda module, x, cache: module(x, cache), name="main",
                                     args=(torch.randn(4, 8), torch.zeros(64, 8, dtype=torch.float16)),
                                     dynamic_shapes={"x": {0: rows}, "cache": {}}, strict=False)
    return aot.export(fxb), list(program.graph.nodes), len(decompositions)


def operations(mlir: str) -> Counter:
    return Counter(op for op in re.findall(r"torch\.(?:aten|prims)\.[\w.]+", mlir) if "assert" not in op)


def test_one_trace_gives_the_usual_operations_and_no_stacks(monkeypatch):
    usual, usual_nodes, usual_passes = export(False, monkeypatch)
    fast, fast_nodes, fast_passes = export(True, monkeypatch)
    assert usual_passes == 1 and fast_passes == 0
    def from_the_model(nodes):  # torch's own passes may still note where they made a node
        return [node for node in nodes if __file__.split("/")[-1] in (node.meta.get("stack_trace") or "")]

    assert from_the_model(usual_nodes) and not from_the_model(fast_nodes)
    usual_ops, fast_ops = operations(str(usual.mlir_module)), operations(str(fast.mlir_module))
    # The dtype copy: prims' convert after the decomposing pass, aten's _to_copy in one (the
    # import lowers both to the same conversion).
    assert usual_ops.pop("torch.prims.convert_element_type") == fast_ops.pop("torch.aten._to_copy") == 1
    assert fast_ops == usual_ops
    assert usual_ops["torch.aten.linear"] == 1 and usual_ops["torch.aten.matmul"] == 1  # kept whole
    assert not torch.fx.config.do_not_emit_stack_traces  # put back


def test_the_export_of_a_model_traces_fast(monkeypatch, tmp_path):
    """trace_module traces inside fast_tracing: no decomposing pass for any function."""
    pytest.importorskip("torch.export._trace")
    from kiln.export import exporter

    # Each function is traced in a process forked for it: what they did comes back in files.
    entered, passes = tmp_path / "entered", tmp_path / "passes"
    real = exporter.fast_tracing

    def noted(path: Path) -> None:
        with open(path, "a") as noting:
            noting.write("1")

    def watched(*args):
        noted(entered)
        return real(*args)

    monkeypatch.setattr(exporter, "fast_tracing", watched)
    from kiln.export.options import ExportOptions
    from kiln.models.llama import PagedLlama
    from tests.tiny_model import make_tiny_checkpoint

    checkpoint = make_tiny_checkpoint(seed=0)
    model = PagedLlama(checkpoint.config, block_seq_stride=16)
    model.load_tensors(checkpoint.tensors)
    options = ExportOptions(prefill_batch_sizes=(1,), decode_batch_sizes=(1,), max_seq_len=64, device_block_count=8,
                            decode_buckets=()).validate(256)
    run = torch.export.ExportedProgram.run_decompositions
    monkeypatch.setattr(torch.export.ExportedProgram, "run_decompositions",
                        lambda self, *args, **kwargs: noted(passes) or run(self, *args, **kwargs))
    with torch.no_grad():
        exporter.trace_module(model, options, tmp_path, tmp_path / "model.mlir", log=lambda line: None)
    assert len(entered.read_text()) == len(exporter.planned_functions(model, options)) and not passes.exists()
    assert "func.func @decode_bs1" in (tmp_path / "model.mlir").read_text()


def test_the_import_looks_for_no_dialect_module_in_vain():
    """Once `answer_dialect_lookups` has run, importing a program to MLIR makes no failed import
    (before, one per op and type the import makes), and the MLIR is what it was. In a process of
    its own: MLIR remembers, for the process, a module it once found."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import sys, torch
        from iree.turbine import aot
        from torch.export import Dim
        from kiln.export.fast_trace import _DIALECTS_WITHOUT_MODULES, answer_dialect_lookups, fast_tracing
        from tests.export.test_fast_trace import Cached

        looked_for = []

        class Spy:
            def find_spec(self, name, path=None, target=None):
                looked_for.append(name)

        sys.meta_path.append(Spy())

        def imported():
            looked_for.clear()
            torch.manual_seed(0)
            fxb = aot.FxProgramsBuilder(Cached())
            with torch.no_grad(), fast_tracing():
                fxb.export_program(lambda module, x, cache: module(x, cache), name="main",
                                   args=(torch.randn(4, 8), torch.zeros(64, 8, dtype=torch.float16)),
                                   dynamic_shapes={"x": {0: Dim("rows", min=2, max=64)}, "cache": {}}, strict=False)
                text = str(aot.export(fxb).mlir_module)
            return text, sum(name in _DIALECTS_WITHOUT_MODULES for name in looked_for)

        before, failed_before = imported()
        answer_dialect_lookups()
        after, failed_after = imported()
        print(failed_before, failed_after, after == before)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[2])
    failed_before, failed_after, same = done.stdout.split()[-3:]
    assert int(failed_before) > 10 and int(failed_after) == 0 and same == "True", done.stderr[-2000:]


def test_the_metadata_pass_runs_the_first_layer_and_the_program_is_the_same(monkeypatch, tmp_path):
    """AOT autograd's first run of the model, which learns only what the call mutates and returns,
    goes through the first layer alone; the graph pass through all of them. The tiny model's
    prefill and decode (the cache written in place) import to the same MLIR as with every layer
    in both runs."""
    pytest.importorskip("torch.export._trace")
    from kiln.export import exporter, fast_trace
    from kiln.export.options import ExportOptions
    from kiln.models.llama import PagedLlama
    from tests.tiny_model import make_tiny_checkpoint

    checkpoint = make_tiny_checkpoint(seed=0)
    model = PagedLlama(checkpoint.config, block_seq_stride=16)
    model.load_tensors(checkpoint.tensors)
    layers = len(model.model.layers)
    assert layers > 1
    options = ExportOptions(prefill_batch_sizes=(1,), decode_batch_sizes=(2,), max_seq_len=64, device_block_count=8,
                            decode_buckets=()).validate(256)
    functions = exporter.planned_functions(model, options)
    runs = []  # the layers (their MLPs) each run of the model went through
    forward = PagedLlama.forward_paged

    def counted(self, *args):
        ran = []
        hooks = [layer.mlp.register_forward_pre_hook(lambda module, inputs: ran.append(1))
                 for layer in self.model.layers]
        try:
            return forward(self, *args)
        finally:
            runs.append(len(ran))
            for hook in hooks:
                hook.remove()

    monkeypatch.setattr(PagedLlama, "forward_paged", counted)
    (tmp_path / "first").mkdir()
    with torch.no_grad():
        exporter.trace_functions(model, options, functions, tmp_path / "first", log=lambda line: None)
    assert runs == [1, layers] * len(functions)  # the metadata run, then the graph's
    assert model.running_layers is None  # every layer again once the pass is over

    runs.clear()
    monkeypatch.setattr(fast_trace, "_metadata_from_first_layer", lambda model: contextlib.nullcontext())
    (tmp_path / "every").mkdir()
    with torch.no_grad():
        exporter.trace_functions(model, options, functions, tmp_path / "every", log=lambda line: None)
    assert runs == [layers, layers] * len(functions)
    for planned in functions:
        first = exporter.function_module_path(tmp_path / "first", planned).read_text()
        every = exporter.function_module_path(tmp_path / "every", planned).read_text()
        assert first == every, planned.name
