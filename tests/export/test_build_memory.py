"""`kiln build` keeps nothing of the model in memory while iree-compile runs: the checkpoint's
tensors and the traced model would otherwise sit beside the compiler's own peak."""

from __future__ import annotations

import gc

from kiln.export.options import ExportOptions
from kiln.models.checkpoint import Checkpoint
from kiln.models.llama import PagedLlama


def test_nothing_of_the_model_is_alive_while_the_compiler_runs(tiny_hf_dir, tmp_path, monkeypatch):
    import kiln.export.build as build_module

    def models() -> dict[int, str]:
        # Every object the collector tracks, those in unreachable cycles not yet collected included.
        return {id(o): type(o).__name__ for o in gc.get_objects() if isinstance(o, (Checkpoint, PagedLlama))}

    before = models()  # the session's own (the fixtures' checkpoint)
    alive = []

    def compile_vmfb(mlir, vmfb, *args, **kwargs):
        alive.append(sorted(name for key, name in models().items() if key not in before))
        vmfb.write_bytes(b"")

    monkeypatch.setattr(build_module, "compile_vmfb", compile_vmfb)
    options = ExportOptions(prefill_batch_sizes=(1,), decode_batch_sizes=(1,), block_seq_stride=16, max_seq_len=256,
                            device_block_count=16)
    out = build_module.build(tiny_hf_dir, options, ["cpu"], output_dir=tmp_path / "out", log=lambda line: None)
    assert (out / "model.mlir").is_file()
    assert alive == [[]]
