"""Which build of the CPU kernels a CPU runs, from its /proc/cpuinfo flags: the choice alone, no
compiler needed, so it is checked on every machine whatever its own CPU."""

from __future__ import annotations

import pytest

from kiln.export import cpu_kernels

# /proc/cpuinfo's flags (the ones the choice reads) of CPUs users run on.
ZEN3 = {"sse4_2", "avx", "avx2", "fma", "f16c"}
SKYLAKE_SP = ZEN3 | {"avx512f", "avx512dq", "avx512cd", "avx512bw", "avx512vl"}
CASCADE_LAKE = SKYLAKE_SP | {"avx512_vnni"}
SAPPHIRE_RAPIDS = CASCADE_LAKE | {"avx512_bf16", "amx_int8"}
AVX512F_ONLY = {"avx", "fma", "avx512f", "avx512cd"}


@pytest.mark.parametrize(("flags", "build", "blocks"), [
    (ZEN3, "avx2", True),
    (SKYLAKE_SP, "avx2", True),  # AVX-512 without VNNI: the AVX2 build's block kernels beat none
    (CASCADE_LAKE, "avx512", True),
    (SAPPHIRE_RAPIDS, "avx512", True),
    (AVX512F_ONLY, "avx512", False),  # AVX-512F without AVX2: the float32 kernels only
    ({"sse4_2", "avx"}, None, False),
], ids=["zen3", "skylake-sp", "cascade-lake", "sapphire-rapids", "avx512f-only", "avx"])
def test_each_cpu_runs_the_build_whose_block_kernels_it_has(monkeypatch, flags, build, blocks):
    monkeypatch.setattr(cpu_kernels.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cpu_kernels, "_host_cpu_flags", lambda: frozenset(flags))
    assert cpu_kernels.instruction_set() == build
    assert cpu_kernels.blocks_supported() == blocks


def test_no_build_is_chosen_off_x86_64(monkeypatch):
    monkeypatch.setattr(cpu_kernels.platform, "machine", lambda: "aarch64")
    assert cpu_kernels.instruction_set() is None
    assert "x86-64" in cpu_kernels.support_problem()
