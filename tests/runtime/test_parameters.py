"""Where the parameters live in host memory: the compiled tiny model answers the same from its
file mapped and from private memory advised for huge pages; "auto" picks per device; bad
choices are refused before anything loads."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from kiln.runtime import parameters
from kiln.runtime.contract import Artifacts
from kiln.runtime.errors import ModelLoadError
from kiln.runtime.program import Program
from kiln.runtime.service_config import ServiceConfig
from tests.paged_driver import PagedDriver


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping that starts at `address` (smaps: "hg" is MADV_HUGEPAGE)."""
    with open("/proc/self/smaps") as smaps:
        current = None
        for line in smaps:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                current = int(head.split("-")[0], 16)
            elif head == "VmFlags:" and current == address:
                return line.split()[1:]
    raise AssertionError(f"no mapping starts at {address:#x}")


def _first_logits(program: Program) -> np.ndarray:
    driver = PagedDriver(program)
    seqs = driver.new_sequences(1, 32)
    return driver.prefill(seqs, [[5, 17, 99, 3, 250, 41, 7]], batch=1)[0]


def test_private_memory_in_huge_pages_answers_as_the_mapped_file(tiny_artifacts):
    artifacts = Artifacts.in_directory(tiny_artifacts)
    mapped = Program(artifacts, parameter_memory="mapped")
    private = Program(artifacts, parameter_memory="private")
    assert (mapped.parameters.memory, private.parameters.memory) == ("mapped", "private")
    address = ctypes.addressof(ctypes.c_char.from_buffer(private.parameters._region))
    flags = _vm_flags(address)
    assert "hg" in flags or not parameters.huge_pages_on_request()  # advised where the OS offers it
    np.testing.assert_array_equal(_first_logits(private), _first_logits(mapped))


def test_auto_is_private_on_the_cpu_where_huge_pages_are_offered(monkeypatch):
    monkeypatch.setattr(parameters, "huge_pages_on_request", lambda: True)
    assert parameters.resolved("auto", "local-task") == "private"
    assert parameters.resolved("auto", "cuda://0") == "mapped"
    assert parameters.resolved("mapped", "local-task") == "mapped"
    monkeypatch.setattr(parameters, "huge_pages_on_request", lambda: False)
    assert parameters.resolved("auto", "local-task") == "mapped"
    assert parameters.resolved("private", "local-sync") == "private"


def test_a_bad_choice_is_refused_before_loading(tiny_artifacts):
    with pytest.raises(ValueError, match="parameter memory must be one of auto, mapped, private"):
        Program(Artifacts.in_directory(tiny_artifacts), parameter_memory="huge")
    with pytest.raises(ValueError, match="parameter_memory must be one of"):
        ServiceConfig(Artifacts.in_directory(tiny_artifacts), parameter_memory="huge")
    missing = Artifacts.in_directory(tiny_artifacts)
    with pytest.raises(ModelLoadError, match="does not exist"):
        Program(Artifacts(missing.vmfb, tiny_artifacts / "absent.irpa", missing.config), parameter_memory="private")
