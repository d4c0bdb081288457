"""`kiln build`: what it picks by target, and nothing of the model kept in memory while
iree-compile runs (the checkpoint's tensors and the traced model would otherwise sit beside the
compiler's own peak)."""

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


def test_a_build_for_gpus_alone_fuses_attention_and_samples_on_the_device():
    """Attention as IREE's fused op is a GPU's fast form and several times slower on the CPU, and
    sampling functions spare a GPU step the logits' copy: a build picks both only when every
    target is a GPU, and an explicit choice stands."""
    from kiln.export.build import for_targets

    gpu = for_targets(ExportOptions(), ["cuda", "rocm"])
    assert (gpu.attention, gpu.sampling_functions) == ("fused", True)
    mixed = for_targets(ExportOptions(), ["cpu", "cuda"])
    assert (mixed.attention, mixed.sampling_functions) == ("matmuls", False)
    chosen = for_targets(ExportOptions(attention="matmuls", sampling_functions=False), ["cuda"])
    assert (chosen.attention, chosen.sampling_functions) == ("matmuls", False)
    assert for_targets(ExportOptions(attention="fused", sampling_functions=True), ["cpu"]).sampling_functions
    # A build whose functions return top-k values, or one over several devices, samples on the host.
    assert not for_targets(ExportOptions(top_k=4), ["cuda"]).sampling_functions
    assert not for_targets(ExportOptions(tensor_parallel=2), ["cuda"]).sampling_functions
