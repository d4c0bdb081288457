"""The LoRA kernel (export/lora_kernel.py) compiled alone and run through iree.runtime against the
model's own form (every row's weights gathered, two batch matmuls): rows with different slots,
none (slot 0, all zeros: the kernel reads nothing and writes zeros) and one out of range, one
token (decode) and several chunks of tokens (prefill), at layers past the first."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.export import cpu_kernels, lora_kernel
from kiln.export.compile import run_iree_compile, target_flags
from kiln.models.lora import gathered_delta

pytestmark = pytest.mark.skipif(cpu_kernels.support_problem() is not None, reason=str(cpu_kernels.support_problem()))

LAYERS, SLOTS, RANK = 3, 3, 8  # slots 1-2 hold adapters; slot 0 is the base model's zeros


def _compile_alone(directory, rows: int, fin: int, fout: int, layer: int):
    import iree.runtime as rt

    a_shape, b_shape = [LAYERS, SLOTS, RANK, fin], [LAYERS, SLOTS, RANK, fout]
    name = f"kiln_lora_delta_{rows}x{fin}x{fout}_l{layer}"
    body = lora_kernel._lora_delta_text(name, rows, fin, fout, a_shape, b_shape, layer).strip()
    x_type, y_type = f"tensor<{rows}x?x{fin}xf32>", f"tensor<{rows}x?x{fout}xf32>"
    a_type, b_type = f"tensor<{'x'.join(map(str, a_shape))}xf32>", f"tensor<{'x'.join(map(str, b_shape))}xf32>"
    source = directory / "lora.mlir"
    source.write_text(f"""{body[:-1]}
util.func public @main(%x: {x_type}, %a: {a_type}, %b: {b_type}, %slots: tensor<{rows}xi64>) -> {y_type} {{
  %y = util.call @{name}(%x, %a, %b, %slots) : ({x_type}, {a_type}, {b_type}, tensor<{rows}xi64>) -> {y_type}
  util.return %y : {y_type}
}}
}}""")
    cpu_kernels.build_object(directory)
    run_iree_compile([str(source), *target_flags("cpu"), f"--iree-hal-executable-object-search-path={directory}",
                      "-o", str(directory / "lora.vmfb")], "compiling the LoRA kernel")
    context = rt.SystemContext(config=rt.Config("local-task"))
    context.add_vm_module(rt.VmModule.copy_buffer(context.instance, (directory / "lora.vmfb").read_bytes()))
    return context.modules.module.main


@pytest.mark.e2e
@pytest.mark.parametrize("tokens", [1, 37])
def test_the_kernel_matches_the_gathered_form(tmp_path, tokens):
    rows, fin, fout, layer = 4, 64, 48, 2
    main = _compile_alone(tmp_path, rows, fin, fout, layer)
    rng = np.random.default_rng(tokens)
    a = rng.standard_normal((LAYERS, SLOTS, RANK, fin)).astype(np.float32)
    b = rng.standard_normal((LAYERS, SLOTS, RANK, fout)).astype(np.float32)
    a[:, 0], b[:, 0] = 0, 0
    x = rng.standard_normal((rows, tokens, fin)).astype(np.float32)
    slots = np.array([1, 0, 2, 1], np.int64)
    got = np.asarray(main(x, a, b, slots))
    want = gathered_delta(torch.from_numpy(x), torch.from_numpy(a[layer]), torch.from_numpy(b[layer]),
                          torch.from_numpy(slots)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    assert not got[1].any()  # no adapter: exact zeros
    eager = lora_kernel.lora_delta(*(torch.from_numpy(v) for v in (x, a, b, slots)), layer).numpy()
    np.testing.assert_allclose(eager, want, rtol=1e-6, atol=1e-6)
    # A slot past the stack (a corrupt argument) reads nothing: zeros for that row.
    slots[2] = SLOTS + 5
    assert not np.asarray(main(x, a, b, slots))[2].any()


def test_exports_with_the_kernels_give_it_to_the_adapted_layers(tiny_checkpoint):
    from kiln.export.export_model import build_model
    from kiln.export.options import ExportOptions

    def kernel(**options):
        model = build_model(tiny_checkpoint, ExportOptions(lora_slots=2, **options).validate(256))
        return model.model.layers[0].self_attn.q_proj.delta_kernel

    assert kernel(cpu_kernels=True) is lora_kernel.lora_delta
    assert kernel(cpu_kernels=False) is None
    assert kernel(cpu_kernels=True, lora_rank=lora_kernel.MAX_RANK + 1) is None
