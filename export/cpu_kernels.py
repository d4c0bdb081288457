"""Hand-written CPU kernels for the weight matmuls of a one-token step, linked into the VMFB.

At batch 1 a decode step's time is the time to read its weights. `cpu_kernels.c` holds the
one-token matmuls of a decode step's rows for float32, bfloat16 and block-quantized int8 weights
(Q8_0, Q4_0, Q4_1: both scales, the offset term and the sum over the blocks in one loop; 4-bit
blocks stored two values a byte for Q4_0, Q4_1 and Q4_K), that read several weight rows side by
side with a prefetch ahead of them. Each input row's result is computed the same way whatever
other rows share the call, so that a decode step's results do not depend on its batch. The
export compiles them with the system's C compiler into an object file beside the MLIR, and each
weight matmul of those kinds becomes a dispatch of one: a `stream.executable` whose function
calls the object's symbol, which IREE links into its embedded ELF (IREE's "custom dispatch"
mechanism); the int8 block kernel also takes int8 weights with a scale per row, each block
taking its row's. A prefill's matmuls over 4-bit values run the 4-bit kernel too (its row count
dynamic); every other prefill matmul keeps IREE's code.
What they measured against IREE's kernels: benchmarks/NOTES.md, "Hand-written one-row matmuls".
The same object holds the decode attention kernel that export/cpu_attention.py dispatches.

The object is built for the machine that exports, so an export with these kernels compiles for
the CPU only, for the host's architecture. On x86-64 with AVX-512 and VNNI it is `cpu_kernels.c`
(its bfloat16 kernel also needs AVX512-BF16, and bf16 weights keep IREE's kernels on a CPU without
it); on one with AVX2 and FMA but no AVX-512, or AVX-512 without VNNI, it is `cpu_kernels_avx2.c`,
which holds the same entry points but bfloat16's (instruction_set_for).
"""

from __future__ import annotations

import functools
import math
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from iree.compiler import ir
from iree.turbine.runtime.op_reg import CustomOp, KernelBuilder, KernelSelection

from kiln.models.quantize import BLOCK, unpack_nibbles
from kiln.runtime.errors import ExportError

from .compile import CPU_KERNELS_OBJECT as OBJECT_FILE
from .custom_ops import KILN_LIBRARY, emit_function, static_dims
from .weight_matmul import weight_matmul_kernel

# The kernels' source for each instruction set they are written for (cpu_kernels.h: what both share).
SOURCES = {"avx512": Path(__file__).with_name("cpu_kernels.c"), "avx2": Path(__file__).with_name("cpu_kernels_avx2.c")}
# Output rows a workgroup computes: enough work per workgroup to hide its dispatch, and enough
# workgroups for both task workers on the narrowest projection (576 rows: 9 workgroups).
ROWS_PER_WORKGROUP = 64
# The int8 kernel's flags (cpu_kernels.c): offsets, row scales, scales per half block of 16, and
# its input row count above them.
Q8_OFFSETS, Q8_ROW_SCALES, Q8_HALF_BLOCKS, Q8_ROWS_SHIFT = 1, 2, 4, 3
# Freestanding code for IREE's embedded ELF loader: position independent, no stack protector
# (it would call into libc), no unwind tables.
C_FLAGS = ("-O3", "-ffreestanding", "-fPIC", "-fno-stack-protector", "-fno-asynchronous-unwind-tables",
           "-fvisibility=hidden")
# Each source's instruction set (the AVX-512 one's functions name the extensions they add).
ISA_FLAGS = {"avx512": ("-mavx512f", "-mfma"), "avx2": ("-mavx2", "-mfma", "-mf16c")}


def c_compiler() -> str | None:
    """The C compiler the kernels are built with: $CC, else cc, else gcc, if installed."""
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


@functools.lru_cache(maxsize=1)
def _host_cpu_flags() -> frozenset[str]:
    """The CPU's feature flags, read once: every one-row matmul traced asks."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


# What each build's kernels need. The AVX-512 build's block kernels take VNNI's int8 dot products
# and BW's byte shuffles: an AVX-512 CPU without them (Skylake-SP/X) runs the AVX2 build, whose
# block kernels it has, since the default weights are blocks (the two builds differ only in the
# bfloat16 kernel, AVX512-BF16's, which such a CPU lacks anyway).
AVX512_BLOCK_FLAGS = frozenset({"avx512f", "avx512bw", "avx512_vnni", "fma"})
AVX2_FLAGS = frozenset({"avx2", "fma", "f16c"})


def instruction_set_for(flags: frozenset[str]) -> str | None:
    """The build of the kernels a CPU with these /proc/cpuinfo flags runs: "avx512" where it has
    the AVX-512 block kernels' extensions, else "avx2" (AVX2, FMA, F16C), else "avx512" for an
    AVX-512 CPU without AVX2 (its float32 kernels only), else None."""
    if AVX512_BLOCK_FLAGS <= flags:
        return "avx512"
    if AVX2_FLAGS <= flags:
        return "avx2"
    return "avx512" if {"avx512f", "fma"} <= flags else None


def instruction_set() -> str | None:
    """Which build of the kernels this CPU runs (instruction_set_for its flags), or None on a CPU
    with neither build's extensions or not x86-64."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    return instruction_set_for(_host_cpu_flags())


def bf16_supported() -> bool:
    """Whether this CPU runs the bfloat16 kernel (AVX512-BF16); bf16 weights use IREE's where not."""
    return instruction_set() == "avx512" and "avx512_bf16" in _host_cpu_flags()


def blocks_supported() -> bool:
    """Whether this CPU runs the block kernels (AVX512-VNNI's int8 dot products, or AVX2's); the
    block types use IREE's kernels where not."""
    isa = instruction_set()
    return isa == "avx2" or (isa == "avx512" and AVX512_BLOCK_FLAGS <= _host_cpu_flags())


def support_problem() -> str | None:
    """Why this machine cannot build the kernels for itself, or None when it can (its C compiler
    is tried once per process: one too old for the intrinsics counts as none)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the CPU kernels are written for x86-64, this machine is {platform.machine()}"
    if instruction_set() is None:
        return "the CPU kernels need AVX2 and FMA (or AVX-512), which this CPU lacks"
    compiler = c_compiler()
    if compiler is None:
        return "the CPU kernels are compiled with a C compiler, and none was found (set CC, or install gcc)"
    return _compiled(compiler, instruction_set())[1]


@functools.lru_cache(maxsize=4)
def _compiled(compiler: str, isa: str) -> tuple[bytes | None, str | None]:
    """The kernels for `isa` compiled by `compiler`, once per process: (the object file's bytes,
    None), or (None, why they did not compile). The check that the machine can build them keeps
    what it built, and an export writes that."""
    with tempfile.TemporaryDirectory(prefix="kiln-kernels-") as scratch:
        try:
            _compile(compiler, isa, Path(scratch) / OBJECT_FILE)
        except ExportError as error:
            return None, str(error)
        return (Path(scratch) / OBJECT_FILE).read_bytes(), None


def _compile(compiler: str, isa: str, output: Path) -> None:
    done = subprocess.run([compiler, *C_FLAGS, *ISA_FLAGS[isa], "-c", str(SOURCES[isa]), "-o", str(output)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise ExportError(f"compiling the CPU kernels with {compiler} failed: "
                          f"{(done.stderr or done.stdout).strip()[:500]}")


def build_object(directory: Path) -> Path:
    """Compile the kernels into `directory`/OBJECT_FILE; an ExportError says why not."""
    problem = support_problem()
    if problem:
        raise ExportError(problem)
    output = Path(directory) / OBJECT_FILE
    partial = output.with_name(output.name + ".partial")
    partial.write_bytes(_compiled(c_compiler(), instruction_set())[0])
    os.replace(partial, output)
    return output


_ELEMENTS = {torch.float32: "f32", torch.bfloat16: "bf16"}


def executable_header(name: str, export: str, per_workgroup: int = ROWS_PER_WORKGROUP) -> str:
    """The opening of `name`'s executable: the kernels' object for x86-64's embedded ELF, and the
    export `export` run over ceil(workload / per_workgroup) workgroups; its builtin.module follows."""
    return f"""stream.executable private @{name}_executable attributes {{
  hal.executable.objects = #hal.executable.objects<{{
    #hal.executable.target<"llvm-cpu", "embedded-elf-x86_64"> = [#hal.executable.object<{{path = "{OBJECT_FILE}"}}>]
  }}>
}} {{
  stream.executable.export public @{export} workgroups(%n: index) -> (index, index, index) {{
    %groups = affine.apply affine_map<()[s0] -> (s0 ceildiv {per_workgroup})>()[%n]
    %c1 = arith.constant 1 : index
    stream.return %groups, %c1, %c1 : index, index, index
  }}"""


def _row_matmul_text(name: str, k: int, n: int, element: str = "f32", m: int = 1) -> str:
    """A module holding the kernel's executable and `name`, which dispatches it on x [M, K] and
    w [N, K] (both `element`, "f32" or "bf16") for y [M, N] in float32. M reaches the kernel as an
    operand, so the executables of every shape have one body."""
    symbol = f"kiln_row_matmul_{element}"
    memref = f"memref<?x{element}>"
    out = "memref<?xf32>"
    return f"""module {{
{executable_header(name, "row_matmul")}
  builtin.module {{
    func.func private @{symbol}({memref}, {memref}, {out}, index, index, index, index, index)
        attributes {{hal.import.static}}
    func.func @row_matmul(%x_binding: !stream.binding, %w_binding: !stream.binding,
                          %y_binding: !stream.binding, %n: index, %k: index, %m: index) {{
      %c0 = arith.constant 0 : index
      %rows = arith.constant {ROWS_PER_WORKGROUP} : index
      %group = stream.dispatch.workgroup.id[0] : index
      %row0 = arith.muli %group, %rows : index
      %nk = arith.muli %n, %k : index
      %mk = arith.muli %m, %k : index
      %mn = arith.muli %m, %n : index
      %x = stream.binding.subspan %x_binding[%c0] : !stream.binding -> {memref}{{%mk}}
      %w = stream.binding.subspan %w_binding[%c0] : !stream.binding -> {memref}{{%nk}}
      %y = stream.binding.subspan %y_binding[%c0] : !stream.binding -> {out}{{%mn}}
      func.call @{symbol}(%x, %w, %y, %n, %k, %m, %row0, %rows)
          : ({memref}, {memref}, {out}, index, index, index, index, index) -> ()
      return
    }}
  }}
}}
util.func private @{name}(%x: tensor<{m}x{k}x{element}>, %w: tensor<{n}x{k}x{element}>) -> tensor<{m}x{n}xf32> {{
  %n = arith.constant {n} : index
  %k = arith.constant {k} : index
  %m = arith.constant {m} : index
  %x_flat = tensor.collapse_shape %x [[0, 1]] : tensor<{m}x{k}x{element}> into tensor<{m * k}x{element}>
  %w_flat = tensor.collapse_shape %w [[0, 1]] : tensor<{n}x{k}x{element}> into tensor<{n * k}x{element}>
  %y_flat = flow.dispatch @{name}_executable::@row_matmul[%n](%x_flat, %w_flat, %n, %k, %m)
      : (tensor<{m * k}x{element}>, tensor<{n * k}x{element}>, index, index, index) -> tensor<{m * n}xf32>
  %y = tensor.expand_shape %y_flat [[0, 1]] output_shape [{m}, {n}] : tensor<{m * n}xf32> into tensor<{m}x{n}xf32>
  util.return %y : tensor<{m}x{n}xf32>
}}
}}"""


@CustomOp.register(library=KILN_LIBRARY)
class row_matmul(CustomOp):
    """x [M, K] @ w [N, K]^T -> float32 [M, N], x and w both float32 or both bfloat16, through
    the hand-written kernel (M static: a decode step's rows)."""

    signature = "row_matmul(Tensor x, Tensor w) -> Tensor"

    def select(self, ksel: KernelSelection):
        x, w = ksel.arg_tensor(0), ksel.arg_tensor(1)
        torch._check(x.t.dtype == w.t.dtype and x.t.dtype in _ELEMENTS and x.t.dim() == w.t.dim() == 2,
                     lambda: f"row_matmul: x [1, K] and w [N, K] of one type, float32 or bfloat16, "
                             f"got {x.t.dtype} and {w.t.dtype}")
        torch._check(x.t.shape[1] == w.t.shape[1], lambda: "row_matmul: x [M, K], w [N, K]")
        x.specialize_dims(0, 1)
        w.specialize_dims(0, 1)
        ksel.return_new_tensor([x.t.shape[0], w.t.shape[0]], torch.float32).specialize_dims(0, 1)

    def eager_execute(self, x, w):
        return x.float() @ w.float().T

    def generate(self, ksel: KernelSelection, kb: KernelBuilder):
        m = ir.RankedTensorType(kb.arg_bindings[0].type).shape[0]
        w_type = ir.RankedTensorType(kb.arg_bindings[1].type)
        n, k = w_type.shape
        element = "bf16" if isinstance(w_type.element_type, ir.BF16Type) else "f32"
        name = f"kiln_row_matmul_{element}_{m}x{n}x{k}"
        emit_function(kb, name, _row_matmul_text(name, k, n, element, m))


def _row_blocks_text(name: str, k: int, n: int, has_offset: bool, packed: bool = False, m: int | None = 1,
                     row_scales: bool = False, half_blocks: bool = False) -> str:
    """A module holding the block kernel's executable and `name`, which dispatches it on `m` rows
    of quantized input (q [M, K] int8, its block scales xs [M, G] and, with offsets, its block
    sums xsum [M, G]) and a block weight (w [N, K] int8, scales ws [G, N], offsets wo [G, N]) for
    y [M, N] in float32; `m` None: a dynamic row count (a prefill's tokens). Without offsets, xs
    and ws stand in for the unread xsum and wo.
    `row_scales`: an int8 weight with a scale per row (ws [N]) that every block takes.
    `half_blocks`: a scale per half block of 16 (ws [2 G, N], Q6_K's), no offsets.
    `packed`: the 4-bit kernel, w holding values two a byte ([N, K / 2]) with offsets. The
    executable reads every size from its operands, so those of all shapes are one and the same
    (IREE merges them; executables of one name and different bodies would clash)."""
    groups, width = k // BLOCK, k // 2 if packed else k
    i8, f32 = "memref<?xi8>", "memref<?xf32>"
    rows = "?" if m is None else str(m)
    input_sums = ((groups,), "f32")
    scales = (n,) if row_scales else (2 * groups if half_blocks else groups, n)
    # (operand, dims, element, whether its leading size is the input's row count)
    operands = [("q", (k,), "i8", True), ("xs", *input_sums, True), ("w", (n, width), "i8", False),
                ("ws", scales, "f32", False)]
    if has_offset:
        operands += [("xsum", *input_sums, True), ("wo", (groups, n), "f32", False)]
    shape = {a: (rows, *map(str, dims)) if per_row else tuple(map(str, dims)) for a, dims, _, per_row in operands}
    tensor = {a: f"tensor<{'x'.join(shape[a])}x{element}>" for a, _, element, _ in operands}
    arguments = ", ".join(f"%{a}: {tensor[a]}" for a, _, _, _ in operands)
    # Every operand as the 1-D buffer the kernel reads; an input row's operand with its element
    # count (%<name>_count, a multiple of %m) where the row count is dynamic.
    flat = {a: f"%{a}_flat" if len(shape[a]) == 2 else f"%{a}" for a, _, _, _ in operands}
    flat_type, counts, constants = {}, [], {n} if m is None else set()
    for a, dims, element, per_row in operands:
        size = math.prod(dims)
        if per_row and m is None:
            flat_type[a] = f"tensor<?x{element}>{{%{a}_count}}"
            counts.append(f"%{a}_count = arith.muli %m, %c{size} : index")
            constants.add(size)
        else:
            flat_type[a] = f"tensor<{size * m if per_row else size}x{element}>"
    collapses = "\n  ".join(f"{flat[a]} = tensor.collapse_shape %{a} [[0, 1]] : {tensor[a]} into "
                            f"{flat_type[a].split('{')[0]}" for a, _, _, _ in operands if len(shape[a]) == 2)
    if not has_offset:
        flat["xsum"], flat["wo"], flat_type["xsum"], flat_type["wo"] = flat["xs"], flat["ws"], flat_type["xs"], \
            flat_type["ws"]
    # The third size operand: how many input rows the 4-bit kernel (which always adds offsets)
    # takes, or the int8 kernel's flags with the row count above them (Q8_ROWS_SHIFT). The row
    # count is an operand, so that one body serves every shape.
    flags = Q8_OFFSETS * has_offset | Q8_ROW_SCALES * row_scales | Q8_HALF_BLOCKS * half_blocks
    if m is None:
        m_value = f"%m = tensor.dim %q, %c0 : {tensor['q']}"
        third_value = ("%third = arith.addi %m, %c0 : index" if packed else
                       f"""%flags = arith.constant {flags} : index
  %shift = arith.constant {Q8_ROWS_SHIFT} : index
  %m_shifted = arith.shli %m, %shift : index
  %third = arith.ori %m_shifted, %flags : index""")
    else:
        m_value = f"%m = arith.constant {m} : index"
        third_value = f"%third = arith.constant {m if packed else flags | m << Q8_ROWS_SHIFT} : index"
    if packed:
        symbol, m_line = "kiln_row_matmul_q4", "%m = arith.addi %third, %c0 : index"
    else:
        symbol = "kiln_row_matmul_q8"
        m_line = f"%rows_shift = arith.constant {Q8_ROWS_SHIFT} : index\n      %m = arith.shrui %third, %rows_shift : index"
    export = "row_nibbles" if packed else "row_blocks"  # one name per body: IREE links them all into one
    w_size = "%nk_packed" if packed else "%nk"
    # The scale (and offset) tables' length: [G, N], [N] where the int8 kernel's flags say row
    # scales, [2 G, N] where they say half blocks (its offsets, when it has any, are [G, N] as its
    # scales are; without, wo is ws).
    ws_size = ("%ws_size = arith.muli %groups, %n : index" if packed else
               f"""%scale_flag = arith.andi %third, %c2 : index
      %per_row = arith.cmpi ne, %scale_flag, %c0 : index
      %c1 = arith.constant 1 : index
      %c_half = arith.constant {Q8_HALF_BLOCKS} : index
      %half_flag = arith.andi %third, %c_half : index
      %per_half = arith.cmpi ne, %half_flag, %c0 : index
      %halves = arith.muli %groups, %c2 : index
      %block_rows = arith.select %per_half, %halves, %groups : index
      %scale_rows = arith.select %per_row, %c1, %block_rows : index
      %ws_size = arith.muli %scale_rows, %n : index""")
    flat_types = ", ".join(flat_type[a] for a in ("q", "xs", "xsum", "w", "ws", "wo"))
    out_flat = "tensor<?xf32>{%mn}" if m is None else f"tensor<{m * n}xf32>"
    out_type = f"tensor<{rows}x{n}xf32>"
    mn_line = f"%mn = arith.muli %m, %c{n} : index" if m is None else ""
    setup = "\n  ".join(line for line in ["%c0 = arith.constant 0 : index",
                                           *(f"%c{c} = arith.constant {c} : index" for c in sorted(constants)),
                                           m_value, third_value, *counts, mn_line] if line)
    return f"""module {{
{executable_header(name, export)}
  builtin.module {{
    func.func private @{symbol}({i8}, {f32}, {f32}, {i8}, {f32}, {f32}, {f32}, index, index, index, index,
                                index) attributes {{hal.import.static}}
    func.func @{export}(%q_binding: !stream.binding, %xs_binding: !stream.binding, %xsum_binding: !stream.binding,
                        %w_binding: !stream.binding, %ws_binding: !stream.binding, %wo_binding: !stream.binding,
                        %y_binding: !stream.binding, %n: index, %k: index, %third: index) {{
      %c0 = arith.constant 0 : index
      %c2 = arith.constant 2 : index
      %rows = arith.constant {ROWS_PER_WORKGROUP} : index
      %block = arith.constant {BLOCK} : index
      {m_line}
      %groups = arith.divui %k, %block : index
      %group = stream.dispatch.workgroup.id[0] : index
      %row0 = arith.muli %group, %rows : index
      %mk = arith.muli %m, %k : index
      %mg = arith.muli %m, %groups : index
      %mn = arith.muli %m, %n : index
      %nk = arith.muli %n, %k : index
      %nk_packed = arith.divui %nk, %c2 : index
      {ws_size}
      %q = stream.binding.subspan %q_binding[%c0] : !stream.binding -> {i8}{{%mk}}
      %xs = stream.binding.subspan %xs_binding[%c0] : !stream.binding -> {f32}{{%mg}}
      %xsum = stream.binding.subspan %xsum_binding[%c0] : !stream.binding -> {f32}{{%mg}}
      %w = stream.binding.subspan %w_binding[%c0] : !stream.binding -> {i8}{{{w_size}}}
      %ws = stream.binding.subspan %ws_binding[%c0] : !stream.binding -> {f32}{{%ws_size}}
      %wo = stream.binding.subspan %wo_binding[%c0] : !stream.binding -> {f32}{{%ws_size}}
      %y = stream.binding.subspan %y_binding[%c0] : !stream.binding -> {f32}{{%mn}}
      func.call @{symbol}(%q, %xs, %xsum, %w, %ws, %wo, %y, %n, %k, %third, %row0, %rows)
          : ({i8}, {f32}, {f32}, {i8}, {f32}, {f32}, {f32}, index, index, index, index, index) -> ()
      return
    }}
  }}
}}
util.func private @{name}({arguments}) -> {out_type} {{
  %n = arith.constant {n} : index
  %k = arith.constant {k} : index
  {setup}
  {collapses}
  %y_flat = flow.dispatch @{name}_executable::@{export}[%n]({flat["q"]}, {flat["xs"]}, {flat["xsum"]}, {flat["w"]},
      {flat["ws"]}, {flat["wo"]}, %n, %k, %third) : ({flat_types}, index, index, index) -> {out_flat}
  %y = tensor.expand_shape %y_flat [[0, 1]] output_shape [{'%m' if m is None else m}, {n}] : {out_flat.split('{')[0]} into {out_type}
  util.return %y : {out_type}
}}
}}"""


def _check_row_blocks(ksel: KernelSelection, count: int, packed: bool = False):
    args = [ksel.arg_tensor(i) for i in range(count)]
    q, xs, w, ws = args[:4]
    torch._check(q.t.dtype == w.t.dtype == torch.int8 and q.t.dim() == w.t.dim() == 2,
                 lambda: "row_blocks: int8 q [M, K] and w [N, K] (or [N, K / 2], two values a byte)")
    width = q.t.shape[1] // 2 if packed else q.t.shape[1]
    torch._check(w.t.shape[1] == width and q.t.shape[1] % BLOCK == 0,
                 lambda: f"row_blocks: K a multiple of {BLOCK}, the same in q and w")
    groups, n = q.t.shape[1] // BLOCK, w.t.shape[0]
    shapes = ((groups, n), (n,)) if packed or count == 6 else ((groups, n), (n,), (2 * groups, n))
    # M may be dynamic (a prefill's tokens), a size of its own here: not compared.
    torch._check(tuple(ws.t.shape) in shapes and xs.t.dim() == 2 and xs.t.shape[1] == groups,
                 lambda: "row_blocks: input scales xs [M, G], block scales ws [G, N] (or row scales ws [N], "
                         "or scales per half block ws [2 G, N] without offsets)")
    floats = [arg for index, arg in enumerate(args) if index not in (0, 2)]
    torch._check(all(a.t.dtype == torch.float32 for a in floats), lambda: "row_blocks: float32 scales and sums")
    for arg in args:
        arg.specialize_dims(*static_dims(arg))
    result = ksel.return_new_tensor([q.t.shape[0], w.t.shape[0]], torch.float32)
    result.specialize_dims(*static_dims(result))


def _input_rows(kb: KernelBuilder) -> int | None:
    """The row count of a block kernel's input (its first operand), None where it is dynamic."""
    rows = ir.RankedTensorType(kb.arg_bindings[0].type).shape[0]
    return None if rows == ir.ShapedType.get_dynamic_size() else rows


def eager_rows_blocks(q, xs, w, ws, xsum=None, wo=None):
    """`eager_row_blocks` for each of M input rows (q [M, K], xs and xsum [M, G]): [M, N]. The
    integer sums are exact in float64; rows go a few at a time, so that a prefill's [rows, G, N]
    sums stay small."""
    groups, n = q.shape[1] // BLOCK, w.shape[0]
    halves = ws.dim() == 2 and ws.shape[0] == 2 * groups
    parts = 2 * groups if halves else groups
    step = max(1, (1 << 24) // (parts * n))
    out = []
    for first in range(0, q.shape[0], step):
        rows = q[first:first + step]
        sums = torch.einsum("rgb,ngb->rgn", rows.reshape(rows.shape[0], parts, -1).double(),
                            w.reshape(n, parts, -1).double()).float() * ws  # [R, parts, N]
        if halves:
            sums = sums.view(rows.shape[0], groups, 2, n).sum(dim=2)
        if wo is not None:
            sums = sums + xsum[first:first + step].unsqueeze(-1) * wo
        out.append((sums * xs[first:first + step].unsqueeze(-1)).sum(dim=1))
    return torch.cat(out) if out else torch.zeros(0, n)


def eager_row_blocks(q, xs, w, ws, xsum=None, wo=None):
    """The block kernel's arithmetic in torch for one input row (q [1, K], xs and xsum [G]):
    block g's int8 sum times ws[g] (ws [G, N]; or the row scales ws [N] for every block; or with
    ws [2 G, N] each half block's sum times its own), plus xsum[g] times wo[g], times xs[g],
    summed over the blocks."""
    return eager_rows_blocks(q, xs.view(1, -1), w, ws, None if xsum is None else xsum.view(1, -1), wo)


@CustomOp.register(library=KILN_LIBRARY)
class row_blocks(CustomOp):
    """A block-quantized weight (w [N, K] int8, ws [G, N], or [2 G, N] with a scale per half block),
    or an int8 one with row scales (ws [N]), times M int8 rows in blocks of 32 (q [M, K], xs [M, G]):
    float32 [M, N], through the hand-written kernel, each row's result the same whatever rows share
    the call."""

    signature = "row_blocks(Tensor q, Tensor xs, Tensor w, Tensor ws) -> Tensor"

    def select(self, ksel: KernelSelection):
        _check_row_blocks(ksel, 4)

    def eager_execute(self, q, xs, w, ws):
        return eager_rows_blocks(q, xs, w, ws)

    def generate(self, ksel: KernelSelection, kb: KernelBuilder):
        m = _input_rows(kb)
        n, k = ir.RankedTensorType(kb.arg_bindings[2].type).shape
        scales = ir.RankedTensorType(kb.arg_bindings[3].type).shape
        row_scales, half_blocks = len(scales) == 1, len(scales) == 2 and scales[0] == 2 * (k // BLOCK)
        form = "row_scales_" if row_scales else "half_blocks_" if half_blocks else ""
        name = f"kiln_row_blocks_{form}{m or 'D'}x{n}x{k}"
        emit_function(kb, name, _row_blocks_text(name, k, n, has_offset=False, m=m, row_scales=row_scales,
                                                 half_blocks=half_blocks))


@CustomOp.register(library=KILN_LIBRARY)
class row_blocks_offset(CustomOp):
    """row_blocks plus each block's input sum (xsum [G]) times its offset (wo [G, N])."""

    signature = "row_blocks_offset(Tensor q, Tensor xs, Tensor w, Tensor ws, Tensor xsum, Tensor wo) -> Tensor"

    def select(self, ksel: KernelSelection):
        _check_row_blocks(ksel, 6)

    def eager_execute(self, q, xs, w, ws, xsum, wo):
        return eager_rows_blocks(q, xs, w, ws, xsum, wo)

    def generate(self, ksel: KernelSelection, kb: KernelBuilder):
        m = _input_rows(kb)
        n, k = ir.RankedTensorType(kb.arg_bindings[2].type).shape
        name = f"kiln_row_blocks_offset_{m or 'D'}x{n}x{k}"
        emit_function(kb, name, _row_blocks_text(name, k, n, has_offset=True, m=m))


@CustomOp.register(library=KILN_LIBRARY)
class row_nibbles(CustomOp):
    """row_blocks_offset for 4-bit values stored two a byte (w [N, K / 2] int8, models/quantize.py's
    `pack_nibbles`) and M input rows (q [M, K], xs and xsum [M, G]; float32 [M, N]), through the
    4-bit kernel."""

    signature = "row_nibbles(Tensor q, Tensor xs, Tensor w, Tensor ws, Tensor xsum, Tensor wo) -> Tensor"

    def select(self, ksel: KernelSelection):
        _check_row_blocks(ksel, 6, packed=True)

    def eager_execute(self, q, xs, w, ws, xsum, wo):
        return eager_rows_blocks(q, xs, unpack_nibbles(w), ws, xsum, wo)

    def generate(self, ksel: KernelSelection, kb: KernelBuilder):
        m = _input_rows(kb)
        n, width = ir.RankedTensorType(kb.arg_bindings[2].type).shape
        name = f"kiln_row_nibbles_{m or 'D'}x{n}x{width * 2}"
        emit_function(kb, name, _row_blocks_text(name, width * 2, n, has_offset=True, packed=True, m=m))


# The expert kernel's flag for 4-bit values two a byte, beside the int8 kernel's (cpu_kernels.c).
EXPERT_NIBBLES = 1 << Q8_ROWS_SHIFT


def _expert_blocks_text(name: str, shapes: dict[str, tuple], flags: int) -> str:
    """A module holding the expert kernel's executable and `name`, which dispatches it on M rows of
    quantized input (q [M, K] int8, xs and xsum [M, G]), a stack of block weights (w [E, N, K] int8,
    or [E, N, K / 2] with EXPERT_NIBBLES; ws and wo as `flags` says: see cpu_kernels.c) and
    (expert, input row) pairs ([P, 2] int64) for y [P, N]. `shapes` holds each operand's dims, M
    and P None where they are dynamic (a prefill's tokens). Every size reaches the kernel as an
    operand (one body for every shape, as _row_blocks_text's)."""
    experts, n, _ = shapes["w"]
    k = shapes["q"][1]
    m, pairs = shapes["q"][0], shapes["pairs"][0]
    elements = {"q": "i8", "xs": "f32", "xsum": "f32", "w": "i8", "ws": "f32", "wo": "f32", "pairs": "i64"}
    names = list(elements)
    i8, f32, i64 = "memref<?xi8>", "memref<?xf32>", "memref<?xi64>"

    def spelled(size):
        return "?" if size is None else str(size)

    tensor = {a: f"tensor<{'x'.join(map(spelled, shapes[a]))}x{elements[a]}>" for a in names}
    flat_type = {a: f"tensor<{spelled(None if None in shapes[a] else math.prod(shapes[a]))}x{elements[a]}>"
                 for a in names}
    out_type = f"tensor<{spelled(pairs)}x{n}xf32>"
    out_flat = f"tensor<{spelled(None if pairs is None else pairs * n)}xf32>"
    # A dynamic tensor's element count: its leading size (%m or %p) times the rest, %c<rest>.
    lines, constants, dynamic = [], set(), {}
    for a, dims in [*shapes.items(), ("y", (pairs, n))]:
        if None in dims:
            rest = math.prod(dims[1:])
            constants.add(f"%c{rest} = arith.constant {rest} : index")
            lines.append(f"%{a}_count = arith.muli %{'m' if a in ('q', 'xs', 'xsum') else 'p'}, %c{rest} : index")
            dynamic[a] = f"{{%{a}_count}}"
        else:
            dynamic[a] = ""
    sizes = [f"%m = arith.constant {m} : index" if m is not None else f"%m = tensor.dim %q, %c0 : {tensor['q']}",
             f"%p = arith.constant {pairs} : index" if pairs is not None else
             f"%p = tensor.dim %pairs, %c0 : {tensor['pairs']}"]
    setup = "\n  ".join(["%c0 = arith.constant 0 : index", *sizes, *sorted(constants), *lines])
    arguments = ", ".join(f"%{a}: {tensor[a]}" for a in names)
    collapses = "\n  ".join(
        f"%{a}_flat = tensor.collapse_shape %{a} [[{', '.join(map(str, range(len(shapes[a]))))}]] : {tensor[a]} "
        f"into {flat_type[a]}" for a in names)
    flats = ", ".join(f"%{a}_flat" for a in names)
    flat_types = ", ".join(f"{flat_type[a]}{dynamic[a]}" for a in names)
    return f"""module {{
{executable_header(name, "expert_blocks")}
  builtin.module {{
    func.func private @kiln_expert_matmul({i8}, {f32}, {f32}, {i8}, {f32}, {f32}, {i64}, {f32}, index, index,
                                          index, index, index, index, index) attributes {{hal.import.static}}
    func.func @expert_blocks(%q_binding: !stream.binding, %xs_binding: !stream.binding,
                             %xsum_binding: !stream.binding, %w_binding: !stream.binding,
                             %ws_binding: !stream.binding, %wo_binding: !stream.binding,
                             %pairs_binding: !stream.binding, %y_binding: !stream.binding, %n: index, %k: index,
                             %e: index, %flags: index, %m: index, %p: index, %w_size: index, %ws_size: index,
                             %wo_size: index) {{
      %c0 = arith.constant 0 : index
      %c2 = arith.constant 2 : index
      %rows = arith.constant {ROWS_PER_WORKGROUP} : index
      %block = arith.constant {BLOCK} : index
      %groups = arith.divui %k, %block : index
      %group = stream.dispatch.workgroup.id[0] : index
      %row0 = arith.muli %group, %rows : index
      %mk = arith.muli %m, %k : index
      %mg = arith.muli %m, %groups : index
      %p2 = arith.muli %p, %c2 : index
      %pn = arith.muli %p, %n : index
      %q = stream.binding.subspan %q_binding[%c0] : !stream.binding -> {i8}{{%mk}}
      %xs = stream.binding.subspan %xs_binding[%c0] : !stream.binding -> {f32}{{%mg}}
      %xsum = stream.binding.subspan %xsum_binding[%c0] : !stream.binding -> {f32}{{%mg}}
      %w = stream.binding.subspan %w_binding[%c0] : !stream.binding -> {i8}{{%w_size}}
      %ws = stream.binding.subspan %ws_binding[%c0] : !stream.binding -> {f32}{{%ws_size}}
      %wo = stream.binding.subspan %wo_binding[%c0] : !stream.binding -> {f32}{{%wo_size}}
      %pairs = stream.binding.subspan %pairs_binding[%c0] : !stream.binding -> {i64}{{%p2}}
      %y = stream.binding.subspan %y_binding[%c0] : !stream.binding -> {f32}{{%pn}}
      func.call @kiln_expert_matmul(%q, %xs, %xsum, %w, %ws, %wo, %pairs, %y, %n, %k, %e, %flags, %p, %row0, %rows)
          : ({i8}, {f32}, {f32}, {i8}, {f32}, {f32}, {i64}, {f32}, index, index, index, index, index, index,
             index) -> ()
      return
    }}
  }}
}}
util.func private @{name}({arguments}) -> {out_type} {{
  %n = arith.constant {n} : index
  %k = arith.constant {k} : index
  %e = arith.constant {experts} : index
  %flags = arith.constant {flags} : index
  %w_size = arith.constant {math.prod(shapes["w"])} : index
  %ws_size = arith.constant {math.prod(shapes["ws"])} : index
  %wo_size = arith.constant {math.prod(shapes["wo"])} : index
  {setup}
  {collapses}
  %y_flat = flow.dispatch @{name}_executable::@expert_blocks[%n]({flats}, %n, %k, %e, %flags, %m, %p, %w_size,
      %ws_size, %wo_size) : ({flat_types}, index, index, index, index, index, index, index, index, index)
      -> {out_flat}{dynamic["y"]}
  %y = tensor.expand_shape %y_flat [[0, 1]] output_shape [{spelled(pairs) if pairs else '%p'}, {n}] : {out_flat} into {out_type}
  util.return %y : {out_type}
}}
}}"""


def eager_expert_blocks(q, xs, xsum, w, ws, wo, pairs, flags):
    """The expert kernel's arithmetic in torch: for each (expert, input row) pair, the one-row
    kernel's product of that row with that expert's weight, [P, N]."""
    nibbles, offsets = bool(flags & EXPERT_NIBBLES), bool(flags & (EXPERT_NIBBLES | Q8_OFFSETS))
    return torch.cat([eager_row_blocks(q[row:row + 1], xs[row], unpack_nibbles(w[expert]) if nibbles else w[expert],
                                       ws[expert], xsum[row] if offsets else None, wo[expert] if offsets else None)
                      for expert, row in pairs.tolist()])


@CustomOp.register(library=KILN_LIBRARY)
class expert_blocks(CustomOp):
    """M int8 rows in blocks of 32 (q [M, K], xs and xsum [M, G]) times a mixture's stacked block
    experts (w [E, N, K] int8, or [E, N, K / 2] two values a byte; scales and offsets as `flags`
    says, see cpu_kernels.c), for (expert, input row) pairs ([P, 2] int64): float32 [P, N] through
    the hand-written kernel, each expert read where it lies. Without offsets, xsum and wo are
    passed and not read (xs and ws will do)."""

    signature = ("expert_blocks(Tensor q, Tensor xs, Tensor xsum, Tensor w, Tensor ws, Tensor wo, Tensor pairs, "
                 "int flags) -> Tensor")

    def select(self, ksel: KernelSelection):
        q, xs, xsum, w, ws, wo, pairs = (ksel.arg_tensor(i) for i in range(7))
        ksel.attr_int(7)
        k = q.t.shape[1]
        n = w.t.shape[1]
        torch._check(q.t.dtype == w.t.dtype == torch.int8 and k % BLOCK == 0 and w.t.shape[2] in (k, k // 2),
                     lambda: "expert_blocks: int8 q [M, K] and w [E, N, K] (or [E, N, K / 2]), K a multiple of 32")
        # M and P may be dynamic (a prefill's), each then a size of its own here: not compared.
        torch._check(xs.t.shape[1] == xsum.t.shape[1] == k // BLOCK and ws.t.shape[-1] == wo.t.shape[-1] == n,
                     lambda: "expert_blocks: xs and xsum [M, G], scales and offsets [E, ..., N]")
        torch._check(all(a.t.dtype == torch.float32 for a in (xs, xsum, ws, wo)),
                     lambda: "expert_blocks: float32 scales and sums")
        torch._check(pairs.t.dtype == torch.int64 and pairs.t.dim() == 2 and pairs.t.shape[1] == 2,
                     lambda: "expert_blocks: pairs [P, 2] int64 (expert, input row)")
        for arg in (q, xs, xsum, w, ws, wo, pairs):  # a prefill's rows and pairs are dynamic
            arg.specialize_dims(*static_dims(arg))
        result = ksel.return_new_tensor([pairs.t.shape[0], n], torch.float32)
        result.specialize_dims(*static_dims(result))

    def eager_execute(self, q, xs, xsum, w, ws, wo, pairs, flags):
        return eager_expert_blocks(q, xs, xsum, w, ws, wo, pairs, flags)

    def generate(self, ksel: KernelSelection, kb: KernelBuilder):
        def dims(binding) -> tuple:
            return tuple(None if size == ir.ShapedType.get_dynamic_size() else size
                         for size in ir.RankedTensorType(binding.type).shape)

        shapes = dict(zip(("q", "xs", "xsum", "w", "ws", "wo", "pairs"), (dims(b) for b in kb.arg_bindings[:7])))
        flags = ksel.arg_descs[7].v
        sizes = "x".join(str(size or "D") for size in (shapes["q"][0], shapes["pairs"][0], *shapes["w"]))
        scales = "x".join(map(str, shapes["ws"][1:]))
        name = f"kiln_expert_blocks_{flags}_{sizes}_{scales}"
        emit_function(kb, name, _expert_blocks_text(name, shapes, flags))


def experts_blocks(q, xs, w, ws, xsum=None, wo=None, *, pairs, packed=False, half_blocks=False):
    """`experts_blocks` of the matmul contract (models/quantized_experts.py) as the expert kernel: the
    form's flags from its scales (a row's [E, N], half blocks' [E, 2 G, N]), offsets and packing."""
    flags = (EXPERT_NIBBLES if packed else Q8_OFFSETS * (wo is not None) | Q8_ROW_SCALES * (ws.dim() == 2)
             | Q8_HALF_BLOCKS * half_blocks)
    return expert_blocks(q, xs, xs if xsum is None else xsum, w, ws, ws if wo is None else wo, pairs, flags)


def rows_blocks(q, xs, w, ws, xsum=None, wo=None):
    """`rows_blocks` of the matmul contract (models/quantize.py) as the block kernel."""
    return row_blocks(q, xs, w, ws) if wo is None else row_blocks_offset(q, xs, w, ws, xsum, wo)


def row_matmul_kernel(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None = None,
                      x_sum: torch.Tensor | None = None, w_offset: torch.Tensor | None = None) -> torch.Tensor:
    """`weight_matmul_kernel`'s contract, plus float32 weights: a decode step's rows of float32,
    or of bfloat16 where the CPU has AVX512-BF16, run the hand-written kernel at every batch size,
    whose arithmetic for a row is the same whatever rows share the call (IREE's packed matmul,
    faster at a wide batch, tiles its sums by the batch); a prefill's rows run IREE's kernels."""
    rows = x.shape[0] if x.dim() == 2 and isinstance(x.shape[0], int) else None
    if w.dtype == torch.bfloat16 and rows is not None and bf16_supported():
        return row_matmul(x, w)
    if w.dtype != torch.float32:
        return weight_matmul_kernel(x, w, w_scale, x_sum, w_offset)
    return row_matmul(x, w) if rows is not None else x @ w.transpose(-1, -2)


# A block weight times rows of input, whole (models/quantize.py's `rows_blocks`, and
# `rows_nibbles` for 4-bit values two a byte and any rows of input), where this CPU runs the
# block kernels.
if blocks_supported():
    row_matmul_kernel.rows_blocks = rows_blocks
    row_matmul_kernel.rows_nibbles = row_nibbles
    row_matmul_kernel.experts_blocks = experts_blocks
