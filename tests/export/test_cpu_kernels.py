"""Kiln's hand-written CPU kernels for one-row weight matmuls (`--cpu-kernels`): each kernel
alone (float32, bf16, the block types with and without offsets) against numpy or its eager form
at shapes with row and channel tails; the tiny model exported with them (float32, bf16, its Q8_0
and Q4_1 GGUFs) against the eager model of the same weights call for call; the exports they
cannot serve refused; builds for the host cached per CPU.

Tolerance: float32 sums in another order than torch's, 1e-4 relative as the other float32 paths
(bf16 and the integer blocks: see each test).
"""

from __future__ import annotations

import numpy as np
import pytest

from kiln.export import cpu_kernels
from kiln.export.compile import CPU_KERNELS_OBJECT, compile_vmfb, run_iree_compile, target_flags
from kiln.export.export_model import build_model
from kiln.export.options import ExportOptions
from kiln.models.loader import load_checkpoint
from kiln.runtime.config import load_model_config
from kiln.runtime.contract import CONFIG_FILE, Artifacts
from kiln.runtime.errors import ExportError
from kiln.runtime.program import Program
from tests.compiled_module import compiled_functions, replays_a_recorded_command_buffer
from tests.conftest import TINY_EXPORT_ARGS, _export_and_compile, run_kiln
from tests.eager_paged import EagerSequence, check_call_for_call
from tests.paged_driver import PagedDriver, relative_error

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(cpu_kernels.support_problem() is not None, reason=str(cpu_kernels.support_problem())),
]


@pytest.fixture(scope="module")
def kernel_artifacts(tiny_hf_dir, tmp_path_factory):
    return _export_and_compile(tiny_hf_dir, tmp_path_factory.mktemp("tiny-cpu-kernels"),
                               [*TINY_EXPORT_ARGS, "--cpu-kernels"])


@pytest.fixture(scope="module", params=["none", "bf16", "int8", "q8_0", "q4_1", "gguf"])
def kernel_export(request, tiny_hf_dir, tiny_checkpoint, tmp_path_factory):
    """(weights, artifacts, eager model): the tiny model with float32, bf16 or int8 (row scales)
    weights, or its Q8_0, (tied) Q4_1 or Q4_K_M-style GGUF as it comes, exported with the
    kernels, and the eager model of the same weights, whose matmuls are IREE's custom ops run
    eagerly (4-bit values one a byte). In the Q4_K_M mix, q/k's Q4_K (two a byte) sit beside v's
    Q6_K in one projection."""
    weights = request.param
    if weights == "none":
        artifacts = request.getfixturevalue("kernel_artifacts")
    elif weights in ("bf16", "int8"):
        if not (cpu_kernels.bf16_supported() if weights == "bf16" else cpu_kernels.blocks_supported()):
            pytest.skip(f"this CPU has no kernel for {weights} weights")
        artifacts = _export_and_compile(tiny_hf_dir, tmp_path_factory.mktemp(f"tiny-cpu-kernels-{weights}"),
                                        [*TINY_EXPORT_ARGS, "--quantize", weights, "--cpu-kernels"])
    else:
        if weights == "q4_1":
            # Laid out as the bundled SmolLM2: tied, so the output head is the Q8_0 embedding (the
            # int8 block kernel) beside Q4_1 layers (the 4-bit kernel), both in one module.
            from kiln.models.gguf_writer import write_gguf
            from tests.tiny_model import make_tiny_checkpoint

            gguf = write_gguf(make_tiny_checkpoint(seed=0, tie_word_embeddings=True),
                              tmp_path_factory.mktemp("tiny-tied-q4_1") / "tiny-tied-q4_1.gguf", dtype="q4_1")
        else:
            gguf = request.getfixturevalue("tiny_k_quant_gguf" if weights == "gguf" else f"tiny_{weights}_gguf")
        artifacts = _export_and_compile(gguf, tmp_path_factory.mktemp(f"tiny-cpu-kernels-{weights}"),
                                        [*TINY_EXPORT_ARGS, "--cpu-kernels"])
        checkpoint = load_checkpoint(gguf)
        # The mix's q/k and v run as separate products with the kernels (its input quantized per
        # 32 for q/k), as one stacked product without them (per 16 for all three); 4-bit values
        # prefill through the kernel (int8 inputs), not widened: their reference is the model with
        # the kernels' arithmetic, run eagerly.
        options = ExportOptions(cpu_kernels=weights in ("gguf", "q4_1")).validate(256, checkpoint.stored_quantization)
        return weights, artifacts, build_model(checkpoint, options)
    # int8's one-row products quantize their input per 32 with the kernels (per 64 without): its
    # reference runs the kernels' arithmetic too.
    options = ExportOptions(quantize=weights, cpu_kernels=weights == "int8")
    return weights, artifacts, build_model(tiny_checkpoint, options.validate(256))


def _compile_kernel_alone(directory, k: int, n: int, element: str, m: int = 1):
    """The kernel's dispatch for x [M, K] and w [N, K], behind a public function, compiled as
    an export's would be."""
    import iree.runtime as rt

    name = f"kiln_row_matmul_{element}_{m}x{n}x{k}"
    body = cpu_kernels._row_matmul_text(name, k, n, element, m).strip()
    assert body.startswith("module {") and body.endswith("}")
    source = directory / "kernel.mlir"
    # main takes float32 and rounds it to `element` (a no-op for f32), as the model's matmul
    # input is rounded, so numpy hands it plain float32 arrays.
    x_type, w_type, y_type = f"tensor<{m}x{k}x{element}>", f"tensor<{n}x{k}x{element}>", f"tensor<{m}x{n}xf32>"
    x32, w32 = f"tensor<{m}x{k}xf32>", f"tensor<{n}x{k}xf32>"
    rounding = "" if element == "f32" else f"""
  %xr = arith.truncf %x : {x32} to {x_type}
  %wr = arith.truncf %w : {w32} to {w_type}"""
    x_in, w_in = ("%x", "%w") if element == "f32" else ("%xr", "%wr")
    source.write_text(f"""{body[:-1]}
util.func public @main(%x: {x32}, %w: {w32}) -> {y_type} {{{rounding}
  %y = util.call @{name}({x_in}, {w_in}) : ({x_type}, {w_type}) -> {y_type}
  util.return %y : {y_type}
}}
}}""")
    cpu_kernels.build_object(directory)
    run_iree_compile([str(source), *target_flags("cpu"), f"--iree-hal-executable-object-search-path={directory}",
                      "-o", str(directory / "kernel.vmfb")], "compiling the kernel")
    config = rt.Config("local-task")
    context = rt.SystemContext(config=config)
    context.add_vm_module(rt.VmModule.copy_buffer(context.instance, (directory / "kernel.vmfb").read_bytes()))
    return context.modules.module.main


def _bf16_values(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (to nearest, ties to even), as float32."""
    bits = values.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint32)
    return (rounded << 16).view(np.float32)


@pytest.mark.parametrize("element,m", [("f32", 1), ("f32", 8), ("f32", 7), ("bf16", 1), ("bf16", 2)])
@pytest.mark.parametrize("k,n", [(50, 37), (64, 130), (576, 1536)])
def test_the_kernel_matches_numpy_with_row_and_channel_tails(tmp_path, k, n, element, m):
    """K not a multiple of the vector width (a masked tail), N not a multiple of 4 (rows one at a
    time) nor of a workgroup's 64 rows (a short last workgroup); M input rows four at a time and
    the rest one at a time (7: one four and three)."""
    if element == "bf16" and not cpu_kernels.bf16_supported():
        pytest.skip("this CPU has no AVX512-BF16")
    main = _compile_kernel_alone(tmp_path, k, n, element, m)
    rng = np.random.default_rng(k * n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    got = np.asarray(main(x, w))
    if element == "bf16":
        x, w = _bf16_values(x), _bf16_values(w)
    # bf16 x bf16 products are exact in float32, so both forms hold float32's tolerance.
    want = x.astype(np.float64) @ w.T.astype(np.float64)
    assert got.shape == (m, n)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.sqrt(k))


def _compile_blocks_alone(directory, k: int, n: int, has_offset: bool, packed: bool = False, m: int | None = 1,
                          row_scales: bool = False, half_blocks: bool = False):
    """The block kernel's function alone for m input rows (None: a dynamic count, a prefill's)."""
    name = f"kiln_row_nibbles_{m}x{n}x{k}" if packed else f"kiln_row_blocks_{n}x{k}"
    body = cpu_kernels._row_blocks_text(name, k, n, has_offset, packed, m, row_scales, half_blocks).strip()
    groups, rows = k // 32, "?" if m is None else m
    width = k // 2 if packed else k
    input_sums = f"tensor<{rows}x{groups}xf32>"
    scales = f"tensor<{n}xf32>" if row_scales else f"tensor<{2 * groups if half_blocks else groups}x{n}xf32>"
    types = [f"tensor<{rows}x{k}xi8>", input_sums, f"tensor<{n}x{width}xi8>", scales]
    if has_offset:
        types += [input_sums, f"tensor<{groups}x{n}xf32>"]
    names = ["%q", "%xs", "%w", "%ws", "%xsum", "%wo"][: len(types)]
    return _kernel_main(directory, "blocks", body, name, names, types, f"tensor<{rows}x{n}xf32>")


def _kernel_main(directory, stem: str, body: str, name: str, names: list[str], types: list[str], result: str):
    """`body` (a kernel's module, whose function `name` takes `types`) compiled beside a public
    @main that calls it, with the kernels' object: main, to call through iree.runtime."""
    import iree.runtime as rt

    arguments = ", ".join(f"{a}: {t}" for a, t in zip(names, types))
    (directory / f"{stem}.mlir").write_text(f"""{body[:-1]}
util.func public @main({arguments}) -> {result} {{
  %y = util.call @{name}({", ".join(names)}) : ({", ".join(types)}) -> {result}
  util.return %y : {result}
}}
}}""")
    cpu_kernels.build_object(directory)
    run_iree_compile([str(directory / f"{stem}.mlir"), *target_flags("cpu"),
                      f"--iree-hal-executable-object-search-path={directory}", "-o", str(directory / f"{stem}.vmfb")],
                     f"compiling the {stem} kernel")
    context = rt.SystemContext(config=rt.Config("local-task"))
    context.add_vm_module(rt.VmModule.copy_buffer(context.instance, (directory / f"{stem}.vmfb").read_bytes()))
    return context.modules.module.main


@pytest.mark.parametrize("scales", ["blocks", "offsets", "rows", "halves"])
@pytest.mark.parametrize("k,n", [(64, 37), (96, 130), (1536, 576)])
def test_the_block_kernel_matches_its_eager_form(tmp_path, k, n, scales):
    """An odd number of blocks (96: three, the last one alone), rows not a multiple of 4 or of
    64, int8 values over their whole range and negative inputs (the sign moved onto w); scales
    per block, per block with offsets, per row (int8 with row scales, every block taking its
    row's), or per half block of 16 (Q6_K's)."""
    import torch

    has_offset, row_scales, halves = scales == "offsets", scales == "rows", scales == "halves"
    main = _compile_blocks_alone(tmp_path, k, n, has_offset, row_scales=row_scales, half_blocks=halves)
    rng = np.random.default_rng(k + n + has_offset + 2 * row_scales + 4 * halves)
    groups = k // 32
    q = rng.integers(-127, 128, (1, k)).astype(np.int8)
    w = rng.integers(-127, 128, (n, k)).astype(np.int8)
    xs = rng.uniform(0.001, 0.02, groups).astype(np.float32)
    ws = rng.uniform(0.001, 0.02, n if row_scales else (2 * groups if halves else groups, n)).astype(np.float32)
    args = [q, xs, w, ws]
    if has_offset:
        args += [q.reshape(groups, 32).sum(axis=1).astype(np.float32), rng.uniform(-0.1, 0.1, (groups, n)).astype(np.float32)]
    got = np.asarray(main(*(a.reshape(1, groups) if a.ndim == 1 and a.shape[0] == groups else a for a in args)))
    want = cpu_kernels.eager_row_blocks(*(torch.from_numpy(a) for a in args)).numpy()
    assert got.shape == (1, n)
    assert relative_error(got, want) < 1e-5


@pytest.mark.parametrize("k,n,m", [(64, 37, 1), (96, 130, 3), (160, 72, 5), (1536, 576, 1), (1536, 576, 8)])
def test_the_4_bit_kernel_matches_its_eager_form(tmp_path, k, n, m):
    """Values two a byte for one input row (eight weight rows side by side) and several (four,
    then what is left): two, three and five blocks (four at a time, then what is left), weight
    rows not a multiple of the eight or four read together or of a workgroup's 64, every value
    0-15 against every int8 input; the eager form unpacks them and takes the int8 kernel's
    arithmetic row by row."""
    import torch

    from kiln.models.quantize import pack_nibbles

    main = _compile_blocks_alone(tmp_path, k, n, has_offset=True, packed=True, m=m)
    rng = np.random.default_rng(k * n + m)
    groups = k // 32
    q = rng.integers(-127, 128, (m, k)).astype(np.int8)
    values = rng.integers(0, 16, (n, k)).astype(np.int8)
    xs = rng.uniform(0.001, 0.02, (m, groups)).astype(np.float32)
    ws = rng.uniform(0.001, 0.02, (groups, n)).astype(np.float32)
    xsum = q.reshape(m, groups, 32).sum(axis=-1).astype(np.float32)
    wo = rng.uniform(-0.1, 0.1, (groups, n)).astype(np.float32)
    packed = pack_nibbles(torch.from_numpy(values)).numpy()
    assert packed.shape == (n, k // 2)
    got = np.asarray(main(q, xs, packed, ws, xsum, wo))
    want = np.concatenate([cpu_kernels.eager_row_blocks(*(torch.from_numpy(a) for a in (
        q[i:i + 1], xs[i], values, ws, xsum[i], wo))).numpy() for i in range(m)])
    assert got.shape == (m, n)
    assert relative_error(got, want) < 1e-5


@pytest.mark.skipif(not cpu_kernels.blocks_supported(), reason="this CPU has no block kernel")
@pytest.mark.parametrize("k,n,calls", [(160, 130, (1, 5, 9)), (1536, 72, (203,))])
def test_a_prefill_s_rows_through_the_4_bit_kernel_are_a_decode_step_s(tmp_path, k, n, calls):
    """The 4-bit kernel with a dynamic row count, as a prefill calls it: calls of 1, 5 and 9 rows
    to one compiled function, and of 203 rows of 1,536 channels (the last tile of four short),
    each row bit for bit what the static one-row function (a decode step's) gives it alone, and
    the eager form's within float32's sums."""
    import torch

    from kiln.models.quantize import pack_nibbles

    groups = k // 32
    (tmp_path / "prefill").mkdir()
    (tmp_path / "decode").mkdir()
    prefill = _compile_blocks_alone(tmp_path / "prefill", k, n, has_offset=True, packed=True, m=None)
    decode = _compile_blocks_alone(tmp_path / "decode", k, n, has_offset=True, packed=True, m=1)
    rng = np.random.default_rng(7)
    values = rng.integers(0, 16, (n, k)).astype(np.int8)
    packed = pack_nibbles(torch.from_numpy(values)).numpy()
    ws = rng.uniform(0.001, 0.02, (groups, n)).astype(np.float32)
    wo = rng.uniform(-0.1, 0.1, (groups, n)).astype(np.float32)
    for m in calls:
        q = rng.integers(-127, 128, (m, k)).astype(np.int8)
        xs = rng.uniform(0.001, 0.02, (m, groups)).astype(np.float32)
        xsum = q.reshape(m, groups, 32).sum(axis=-1).astype(np.float32)
        got = np.asarray(prefill(q, xs, packed, ws, xsum, wo))
        assert got.shape == (m, n)
        for row in range(m):
            alone = decode(q[row:row + 1], xs[row:row + 1], packed, ws, xsum[row:row + 1], wo)
            np.testing.assert_array_equal(got[row:row + 1], np.asarray(alone), err_msg=f"{m} rows, row {row}")
        want = cpu_kernels.eager_rows_blocks(*(torch.from_numpy(a) for a in (q, xs, values, ws, xsum, wo)))
        assert relative_error(got, want.numpy()) < 1e-5


def _compile_experts_alone(directory, shapes: dict, flags: int):
    """The expert kernel's function alone for operands of `shapes` (M and P None: dynamic, a prefill's)."""
    name = "kiln_expert_blocks_test"
    body = cpu_kernels._expert_blocks_text(name, shapes, flags).strip()
    elements = {"q": "i8", "xs": "f32", "xsum": "f32", "w": "i8", "ws": "f32", "wo": "f32", "pairs": "i64"}
    types = [f"tensor<{'x'.join(str(d or '?') for d in shapes[a])}x{e}>" for a, e in elements.items()]
    result = f"tensor<{shapes['pairs'][0] or '?'}x{shapes['w'][1]}xf32>"
    return _kernel_main(directory, "experts", body, name, [f"%{a}" for a in elements], types, result)


@pytest.mark.skipif(not cpu_kernels.blocks_supported(), reason="this CPU has no block kernel")
@pytest.mark.parametrize("dynamic", [False, True], ids=["decode", "prefill"])
@pytest.mark.parametrize("form", ["q4", "q8_0", "offsets", "rows", "halves"])
@pytest.mark.parametrize("k,n,m,pairs", [(160, 130, 3, 6), (64, 64, 2, 4)])
def test_the_expert_kernel_reads_each_pair_s_expert_where_it_lies(tmp_path, k, n, m, pairs, form, dynamic):
    """A stack of four experts in each form the one-row kernels take (4-bit blocks two a byte; int8
    blocks, with offsets, with row scales, with a scale per half block) and (expert, input row)
    pairs: each row times its experts (gate and up: rows taken twice, experts repeated, the last
    expert), or one row per pair (down), at static sizes (a decode step's) and dynamic ones (a
    prefill's): each pair's output equal bit for bit to the one-row kernel's for that row and that
    expert alone, and to the eager form's within float32's sums."""
    import torch

    from kiln.models.quantize import pack_nibbles

    experts, groups = 4, k // 32
    packed, has_offset, row_scales, halves = form == "q4", form in ("q4", "offsets"), form == "rows", form == "halves"
    rng = np.random.default_rng(k + n + m + len(form))
    q = rng.integers(-127, 128, (m, k)).astype(np.int8)
    xs = rng.uniform(0.001, 0.02, (m, groups)).astype(np.float32)
    xsum = q.reshape(m, groups, 32).sum(axis=-1).astype(np.float32)
    if packed:
        w = np.stack([pack_nibbles(torch.from_numpy(v)).numpy()
                      for v in rng.integers(0, 16, (experts, n, k)).astype(np.int8)])
    else:
        w = rng.integers(-127, 128, (experts, n, k)).astype(np.int8)
    ws = rng.uniform(0.001, 0.02, (experts, n) if row_scales else (experts, 2 * groups if halves else groups, n))
    ws = ws.astype(np.float32)
    wo = rng.uniform(-0.1, 0.1, (experts, groups, n)).astype(np.float32) if has_offset else ws
    pair_array = np.array(list(zip([3, 0, 3, 1, 2, 3], [p // (pairs // m) for p in range(pairs)])), dtype=np.int64)
    flags = cpu_kernels.EXPERT_NIBBLES if packed else (cpu_kernels.Q8_OFFSETS * has_offset
                                                       | cpu_kernels.Q8_ROW_SCALES * row_scales
                                                       | cpu_kernels.Q8_HALF_BLOCKS * halves)
    arrays = dict(q=q, xs=xs, xsum=xsum if has_offset else xs, w=w, ws=ws, wo=wo, pairs=pair_array)
    shapes = {a: (None, *v.shape[1:]) if dynamic and a in ("q", "xs", "xsum", "pairs") else v.shape
              for a, v in arrays.items()}
    got = np.asarray(_compile_experts_alone(tmp_path, shapes, flags)(*arrays.values()))
    assert got.shape == (pairs, n)
    (tmp_path / "alone").mkdir()
    alone = _compile_blocks_alone(tmp_path / "alone", k, n, has_offset, packed, 1, row_scales, halves)
    for p, (expert, row) in enumerate(pair_array.tolist()):
        one = [q[row:row + 1], xs[row:row + 1], w[expert], ws[expert]]
        if has_offset:
            one += [xsum[row:row + 1], wo[expert]]
        np.testing.assert_array_equal(got[p:p + 1], np.asarray(alone(*one)), err_msg=f"pair {p}")
    want = cpu_kernels.eager_expert_blocks(*(torch.from_numpy(a) for a in arrays.values()), flags)
    assert relative_error(got, want.numpy()) < 1e-5


@pytest.mark.skipif(not cpu_kernels.blocks_supported(), reason="this CPU has no block kernel")
def test_a_4_bit_expert_s_many_pairs_are_each_what_a_pair_alone_gives(tmp_path):
    """A prefill's many tokens choosing one 4-bit expert (150 pairs: more than the 64 the AVX2
    build gathers for one call of its dense kernel, two input rows at a time, and a remainder),
    their rows in any order and taken twice: each pair's output is, bit for bit, the one-row
    kernel's for that row and expert alone."""
    import torch

    from kiln.models.quantize import pack_nibbles

    experts, k, n, m = 3, 96, 72, 80
    groups = k // 32
    rng = np.random.default_rng(150)
    q = rng.integers(-127, 128, (m, k)).astype(np.int8)
    xs = rng.uniform(0.001, 0.02, (m, groups)).astype(np.float32)
    xsum = q.reshape(m, groups, 32).sum(axis=-1).astype(np.float32)
    w = np.stack([pack_nibbles(torch.from_numpy(v)).numpy()
                  for v in rng.integers(0, 16, (experts, n, k)).astype(np.int8)])
    ws = rng.uniform(0.001, 0.02, (experts, groups, n)).astype(np.float32)
    wo = rng.uniform(-0.1, 0.1, (experts, groups, n)).astype(np.float32)
    chosen = np.where(rng.random(160) < 0.9, 1, rng.integers(0, experts, 160))[:150]
    pair_array = np.stack([chosen, rng.integers(0, m, 150)], axis=1).astype(np.int64)
    arrays = dict(q=q, xs=xs, xsum=xsum, w=w, ws=ws, wo=wo, pairs=pair_array)
    shapes = {a: (None, *v.shape[1:]) if a in ("q", "xs", "xsum", "pairs") else v.shape for a, v in arrays.items()}
    got = np.asarray(_compile_experts_alone(tmp_path, shapes, cpu_kernels.EXPERT_NIBBLES)(*arrays.values()))
    assert (chosen == 1).sum() > 128
    (tmp_path / "alone").mkdir()
    alone = _compile_blocks_alone(tmp_path / "alone", k, n, True, True, 1)
    for p, (expert, row) in enumerate(pair_array.tolist()):
        one = alone(q[row:row + 1], xs[row:row + 1], w[expert], ws[expert], xsum[row:row + 1], wo[expert])
        np.testing.assert_array_equal(got[p:p + 1], np.asarray(one), err_msg=f"pair {p}")


ROWS_KINDS = ("f32", "bf16", "q8_0", "q8_0_offsets", "int8_row_scales", "q4")


def _rows_kernel(directory, kind: str, k: int, n: int, m: int):
    """(main, its arguments for m random input rows) for the kernel of `kind`."""
    import torch

    from kiln.models.quantize import pack_nibbles

    directory.mkdir()
    rng = np.random.default_rng(k + n)
    groups = k // 32
    if kind in ("f32", "bf16"):
        x, w = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((n, k)).astype(np.float32)
        return _compile_kernel_alone(directory, k, n, kind, m), [x, w]
    packed, has_offset, row_scales = kind == "q4", kind in ("q4", "q8_0_offsets"), kind == "int8_row_scales"
    main = _compile_blocks_alone(directory, k, n, has_offset, packed, m, row_scales)
    q = rng.integers(-127, 128, (m, k)).astype(np.int8)
    xs = rng.uniform(0.001, 0.02, (m, groups)).astype(np.float32)
    w = rng.integers(0, 16, (n, k)) if packed else rng.integers(-127, 128, (n, k))
    w = pack_nibbles(torch.from_numpy(w.astype(np.int8))).numpy() if packed else w.astype(np.int8)
    ws = rng.uniform(0.001, 0.02, n if row_scales else (groups, n)).astype(np.float32)
    args = [q, xs, w, ws]
    if has_offset:
        args += [q.reshape(m, groups, 32).sum(axis=-1).astype(np.float32),
                 rng.uniform(-0.1, 0.1, (groups, n)).astype(np.float32)]
    return main, args


@pytest.mark.parametrize("kind", ROWS_KINDS)
def test_a_rows_result_is_the_same_whatever_rows_share_the_call(tmp_path, kind):
    """Batch invariance: each row of a five-row call (four together, then one; the 4-bit kernel's
    one-row path reads eight weight rows at a time, its several-row path four) equals that row
    alone, bit for bit, at K and N with tails (five blocks, 130 rows)."""
    if kind == "bf16" and not cpu_kernels.bf16_supported() or kind != "f32" and not cpu_kernels.blocks_supported():
        pytest.skip(f"this CPU has no kernel for {kind}")
    k, n, m = 160, 130, 5
    together, args = _rows_kernel(tmp_path / "together", kind, k, n, m)
    alone, _ = _rows_kernel(tmp_path / "alone", kind, k, n, 1)
    got = np.asarray(together(*args))
    input_rows = {0} if kind in ("f32", "bf16") else {0, 1, 4}  # x; or q, xs, xsum
    for row in range(m):
        one = [a[row:row + 1] if i in input_rows else a for i, a in enumerate(args)]
        np.testing.assert_array_equal(got[row:row + 1], np.asarray(alone(*one)), err_msg=f"row {row}")


# The AVX2 build runs on any CPU with AVX2, FMA and F16C, AVX-512 ones too: where the tests above
# ran the AVX-512 build, the AVX2 one passes the same checks here.
RUNS_AVX2 = cpu_kernels.AVX2_FLAGS <= cpu_kernels._host_cpu_flags()


@pytest.mark.skipif(cpu_kernels.instruction_set() != "avx512" or not RUNS_AVX2,
                    reason="the tests above ran this CPU's only build of the kernels")
def test_the_avx2_build_passes_the_kernel_checks_where_the_avx_512_one_ran_them(tmp_path, monkeypatch):
    """The kernels alone, built from cpu_kernels_avx2.c on a CPU that also runs the AVX-512 build:
    float32 against numpy, each int8 block form and the 4-bit one against their eager forms, a
    prefill's rows equal to a decode step's, every row of a call equal to that row alone, a
    mixture's pairs equal to each pair alone, decode attention over float32 and byte pages against
    the gather path (and never outside the cache or in a scale block), and LoRA's deltas against
    the gathered form."""
    import tests.export.test_cpu_attention as attention
    import tests.export.test_lora_kernel as lora

    monkeypatch.setattr(cpu_kernels, "instruction_set", lambda: "avx2")
    checks = [(test_the_kernel_matches_numpy_with_row_and_channel_tails, (50, 37, "f32", 7)),
              (test_the_kernel_matches_numpy_with_row_and_channel_tails, (576, 1536, "f32", 1)),
              *((test_the_block_kernel_matches_its_eager_form, (96, 130, scales))
                for scales in ("blocks", "offsets", "rows", "halves")),
              *((test_the_4_bit_kernel_matches_its_eager_form, shape)
                for shape in ((96, 130, 3), (160, 72, 5), (1536, 576, 1))),
              (test_a_prefill_s_rows_through_the_4_bit_kernel_are_a_decode_step_s, (160, 130, (1, 5, 9))),
              *((test_a_rows_result_is_the_same_whatever_rows_share_the_call, (kind,))
                for kind in ROWS_KINDS if kind != "bf16"),
              *((test_the_expert_kernel_reads_each_pair_s_expert_where_it_lies, (160, 130, 3, 6, form, True))
                for form in ("q4", "offsets", "halves")),
              (test_a_4_bit_expert_s_many_pairs_are_each_what_a_pair_alone_gives, ()),
              *((attention.test_the_kernel_matches_the_gather_path, case) for case in attention.CASES[3:]),
              *((attention.test_the_byte_kernel_matches_the_gather_path_over_dequantized_pages, (*case, fmt))
                for case in attention.CASES[3:5] for fmt in ("int8", "fp8_e4m3")),
              (attention.test_a_page_past_the_end_of_the_cache_is_never_read, ()),
              (attention.test_the_byte_kernel_never_reads_a_scale_block_as_values, ()),
              *((lora.test_the_kernel_matches_the_gathered_form, (tokens,)) for tokens in (1, 37))]
    for index, (check, arguments) in enumerate(checks):
        directory = tmp_path / f"check{index}"
        directory.mkdir()
        check(directory, *arguments)


def test_every_function_matches_the_eager_model(kernel_export):
    """Prefill at batch 4 (IREE's matmuls; the 4-bit kernel for values two a byte, its row count
    dynamic), then decode at batch 1 and 4 (the kernels, Q6_K's blocks of 16 with a scale per
    half block), and prefill_last's output head over one
    position (the kernels), against the eager model with the same weights, whose one-row products
    take the per-block path. bf16 holds the bf16 tolerance of the quantized exports' tests
    (tests/export/test_quantized_export.py says why); the block types are integer sums up to
    float32 scaling."""
    weights, artifacts, reference = kernel_export
    tolerance = 4e-3 if weights == "bf16" else 1e-4
    mlir = (artifacts / "model.mlir").read_text()
    if weights in ("q4_1", "gguf"):  # the 4-bit layers' kernel; Q4_1's head (Q8_0) the int8 one, in one module
        assert "@row_nibbles" in mlir and "@row_blocks" in mlir
        assert "flow.dispatch @kiln_row_nibbles_Dx" in mlir  # a prefill's rows
    if weights == "gguf":  # Q6_K's v in the int8 kernel, a scale per half block
        assert "flow.dispatch @kiln_row_blocks_half_blocks_" in mlir
    if weights == "int8":  # its row scales in the int8 block kernel
        assert "flow.dispatch @kiln_row_blocks_row_scales_" in mlir
    program = Program(Artifacts.in_directory(artifacts))
    rng = np.random.default_rng(3)
    prompts = [rng.integers(4, 384, n).tolist() for n in (9, 21)]
    driver = check_call_for_call(program, reference, prompts, tolerance, decode_batches=(1, 4, 1, 4))
    [continued] = driver.new_sequences(1, 48)
    prompt = rng.integers(4, 384, 17).tolist()
    last = driver.prefill([continued], [prompt], batch=1, function="prefill_last")
    assert relative_error(last[0, -1], EagerSequence(reference).run_last(prompt)) < tolerance


def test_decode_gives_a_row_the_same_logits_whatever_shares_its_batch(kernel_export):
    """Batch invariance: a sequence's decode logits alone (batch 1) and beside a sequence of
    another length, in every exported batch size, are the same bits, step after step, at every
    precision the kernels serve."""
    weights, artifacts, _ = kernel_export
    program = Program(Artifacts.in_directory(artifacts))
    rng = np.random.default_rng(5)
    prompts = [rng.integers(4, 384, n).tolist() for n in (9, 37)]
    driver = PagedDriver(program)
    seqs = driver.new_sequences(2, 64)
    driver.prefill(seqs, prompts, batch=4)
    tokens, lengths = [7, 11], [len(p) for p in prompts]
    wider = [batch for batch in program.capabilities.decode_batch_sizes if batch > 1]
    assert wider
    for step in range(3):
        alone = driver.decode(seqs[:1], tokens[:1], lengths[:1], batch=1)[0, 0]
        for batch in wider:
            together = driver.decode(seqs, tokens, lengths, batch=batch)[0, 0]
            np.testing.assert_array_equal(together, alone, err_msg=f"{weights}: step {step}, batch {batch}")
        tokens, lengths = [int(alone.argmax()), 3 + step], [length + 1 for length in lengths]


def test_prefill_gives_a_prompt_the_same_logits_whatever_its_batch_or_chunks(kernel_export):
    """Batch invariance in prefill (IREE's matmuls): a prompt's logits alone, in a batch of four
    beside a longer prompt, and as two chunks are the same bits."""
    weights, artifacts, _ = kernel_export
    program = Program(Artifacts.in_directory(artifacts))
    rng = np.random.default_rng(6)
    prompt, longer = rng.integers(4, 384, 9).tolist(), rng.integers(4, 384, 37).tolist()
    driver = PagedDriver(program)
    seqs = driver.new_sequences(4, 64)
    alone = driver.prefill(seqs[:1], [prompt], batch=1)[0, :9]
    together = driver.prefill(seqs[1:3], [prompt, longer], batch=4)[0, :9]
    np.testing.assert_array_equal(together, alone, err_msg=weights)
    driver.prefill(seqs[3:], [prompt[:5]], batch=1)
    chunked = driver.prefill(seqs[3:], [prompt[5:]], batch=1, start_pos=[5])[0, :4]
    np.testing.assert_array_equal(chunked, alone[5:], err_msg=weights)


def test_a_requests_greedy_tokens_and_logprobs_are_the_same_alone_and_in_a_busy_batch(kernel_export):
    """Through the service: each prompt answered alone (decode at batch 1), then the four at once
    (prefilled together, their prompts partly from the prefix cache, decoded at batch 4): the
    same tokens and the same logprobs, to the last bit."""
    from kiln.runtime import LLM, SamplingParams

    weights, artifacts, _ = kernel_export
    rng = np.random.default_rng(9)
    prompts = [rng.integers(4, 384, n).tolist() for n in (5, 19, 33, 47)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    with LLM(artifacts) as llm:
        alone = [llm.generate([prompt], params)[0].completions[0] for prompt in prompts]
        together = [result.completions[0] for result in llm.generate(prompts, params)]
    for one, busy in zip(alone, together):
        assert busy.token_ids == one.token_ids, weights
        assert busy.logprobs == one.logprobs, weights


def test_one_row_matmuls_dispatch_the_kernel_and_the_object_ships_beside_the_mlir(kernel_artifacts):
    mlir = (kernel_artifacts / "model.mlir").read_text()
    assert (kernel_artifacts / CPU_KERNELS_OBJECT).is_file()
    # The tiny model's shapes: fused q/k/v, o, gate/up fused, down, and the tied output head.
    dispatched = {line.split("@kiln_row_matmul_f32_")[1].split("_executable")[0]
                  for line in mlir.splitlines() if "flow.dispatch @kiln_row_matmul_f32_" in line}
    assert len(dispatched) >= 4, dispatched
    assert b"row_matmul" in (kernel_artifacts / "model_cpu.vmfb").read_bytes()  # the executables' export


def test_decode_reads_the_kv_pages_in_place(kernel_artifacts):
    """Every layer of every decode function calls the in-place attention kernel (2 layers, decode at
    batch 1 and 4, each with its fixed-shape twin); prefill keeps the page gather."""
    mlir = (kernel_artifacts / "model.mlir").read_text()
    assert mlir.count("util.call @kiln_paged_decode_attention_") == 2 * 2 * 2
    assert "util.call @kiln_gather_pages_" in mlir


def test_the_fixed_shape_decode_replays_a_command_buffer_recorded_once(kernel_artifacts):
    """With in-place attention the export adds decode_bs<N>_ctx<max_seq_len>, every shape fixed:
    in the compiled module its call loads a command buffer the module recorded when it loaded, where
    decode_bs<N> records one on every call. It returns what decode_bs<N> returns, bit for bit, and
    is what the server calls while its cache has the export's page count."""
    params, kiln = load_model_config(kernel_artifacts / CONFIG_FILE)
    assert kiln.decode_buckets == [params.max_seq_len] == [256]
    functions = compiled_functions(kernel_artifacts / "model_cpu.vmfb")
    for batch in params.decode_batch_sizes:
        assert replays_a_recorded_command_buffer(functions, f"decode_bs{batch}_ctx256")
        assert not replays_a_recorded_command_buffer(functions, f"decode_bs{batch}")

    program = Program(Artifacts.in_directory(kernel_artifacts))
    abi = program.capabilities
    assert abi.decode_function(4, 200, params.paged_kv_cache.device_block_count) == ("decode_bs4_ctx256", 16)
    assert abi.decode_function(4, 200, 65) == ("decode_bs4", 13)  # another cache size: the dynamic decode
    rng = np.random.default_rng(8)
    prompts = [rng.integers(4, 384, n).tolist() for n in (40, 3, 77)]
    driver = PagedDriver(program)
    seqs = driver.new_sequences(3, 96)
    logits = driver.prefill(seqs, prompts, batch=4)
    tokens = [int(logits[row, len(p) - 1].argmax()) for row, p in enumerate(prompts)]
    positions = [len(p) for p in prompts]
    fixed = driver.decode(seqs, tokens, positions, batch=4)
    dynamic = driver.decode(seqs, tokens, positions, batch=4, dynamic=True)
    np.testing.assert_array_equal(fixed, dynamic)


def test_an_export_with_the_kernels_compiles_for_this_cpu_only(kernel_artifacts, tmp_path):
    with pytest.raises(ExportError, match="compiles for the CPU only"):
        compile_vmfb(kernel_artifacts / "model.mlir", tmp_path / "model_cuda.vmfb", "cuda")
    with pytest.raises(ExportError, match="--arch host"):
        compile_vmfb(kernel_artifacts / "model.mlir", tmp_path / "model_cpu.vmfb", "cpu", arch="znver3")
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "model.mlir").write_text((kernel_artifacts / "model.mlir").read_text())
    with pytest.raises(ExportError, match=f"{CPU_KERNELS_OBJECT} is not beside it"):
        compile_vmfb(alone / "model.mlir", alone / "model_cpu.vmfb", "cpu")
    failed = run_kiln("compile-vmfb", str(kernel_artifacts / "model.mlir"), "--target", "rocm",
                      "-o", str(tmp_path / "model_rocm.vmfb"), check=False)
    assert failed.returncode != 0 and "export again without --cpu-kernels" in failed.stderr
    assert "Traceback" not in failed.stderr


def test_the_kernels_are_refused_where_they_cannot_be_built(monkeypatch, tiny_hf_dir, tmp_path):
    with pytest.raises(ExportError, match="one-device export"):
        ExportOptions(cpu_kernels=True, tensor_parallel=2).validate(256)
    # A compiler that cannot build them (too old for the intrinsics) is no compiler for them:
    # `--cpu-kernels auto` then builds without them.
    monkeypatch.setattr(cpu_kernels, "C_FLAGS", ("-mno-such-flag",))
    cpu_kernels._compiled.cache_clear()
    assert "failed" in cpu_kernels.support_problem()
    cpu_kernels._compiled.cache_clear()
    monkeypatch.setenv("CC", "")
    monkeypatch.setattr(cpu_kernels.shutil, "which", lambda name: None)
    assert "C compiler" in cpu_kernels.support_problem()
    with pytest.raises(ExportError, match="C compiler"):
        cpu_kernels.build_object(tmp_path)


def test_builds_for_the_host_are_cached_per_cpu(monkeypatch, tmp_path):
    """A cache shared by machines with other CPUs (`--arch host` code, and the kernels' object,
    are built for the building CPU) gives each CPU a build of its own."""
    from kiln.export import build as build_module

    built = []
    monkeypatch.setattr(build_module, "artifacts_dir", lambda: tmp_path)
    monkeypatch.setattr(build_module, "load_checkpoint", lambda path: None)
    monkeypatch.setattr(build_module, "export_model", lambda checkpoint, options, directory, log: built.append(directory))
    monkeypatch.setattr(build_module, "compile_vmfb", lambda *args, **kwargs: None)
    options = ExportOptions(cpu_kernels=True)
    for cpu in ("one", "one", "another"):
        monkeypatch.setattr(build_module, "host_cpu", lambda cpu=cpu: cpu)
        build_module.build(None, options, ["cpu"], log=lambda line: None)
    assert built[0] == built[1] != built[2]
