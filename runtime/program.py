"""Load a compiled model (VMFB + IRPA parameters) on a HAL device and call its functions.

This is the only place that talks to iree.runtime's module machinery. It knows
the ABI's function names and nothing about requests or pages.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from iree import runtime as ireert

from .config import KilnParams, ModelParams, load_model_config

PARAMETER_SCOPE = "model"


class ProgramLoadError(Exception):
    """Artifacts that are missing, unreadable or do not match each other."""


@dataclass
class Artifacts:
    vmfb: Path
    params: Path
    config: Path
    tokenizer: Path | None = None

    @classmethod
    def in_directory(cls, directory: Path, vmfb_name: str = "model_cpu.vmfb") -> "Artifacts":
        directory = Path(directory)
        return cls(
            vmfb=directory / vmfb_name,
            params=directory / "model.irpa",
            config=directory / "model.json",
            tokenizer=directory / "tokenizer.json",
        )


class Program:
    """The compiled functions of one model on one device, plus its config."""

    def __init__(self, artifacts: Artifacts, device: str = "local-task"):
        for label, path in (("VMFB", artifacts.vmfb), ("parameters", artifacts.params), ("config", artifacts.config)):
            if not Path(path).is_file():
                raise ProgramLoadError(f"{label} file {path} does not exist")
        try:
            self.params, kiln = load_model_config(artifacts.config)
        except (ValueError, TypeError, KeyError) as error:
            raise ProgramLoadError(f"model config {artifacts.config} is invalid: {error}") from None
        self.kiln = kiln or KilnParams()
        try:
            self.device = ireert.get_device(device)
        except Exception as error:  # iree raises plain ValueError/RuntimeError with long texts
            raise ProgramLoadError(f"cannot open device {device!r}: {str(error).splitlines()[0]}") from None
        self.instance = ireert.VmInstance()
        try:
            index = ireert.ParameterIndex()
            index.load(str(artifacts.params))
            params_module = ireert.create_io_parameters_module(
                self.instance, index.create_provider(scope=PARAMETER_SCOPE)
            )
            hal_module = ireert.create_hal_module(self.instance, self.device)
            program_module = ireert.VmModule.mmap(self.instance, str(artifacts.vmfb))
            self.context = ireert.VmContext(self.instance, modules=[hal_module, params_module, program_module])
        except Exception as error:
            raise ProgramLoadError(f"cannot load {artifacts.vmfb} with {artifacts.params}: {str(error).splitlines()[0]}") from None
        self.module = program_module
        self.functions: dict[str, ireert.FunctionInvoker] = {}
        for kind, sizes in (("prefill", self.params.prefill_batch_sizes), ("decode", self.params.decode_batch_sizes)):
            for bs in sizes:
                name = f"{kind}_bs{bs}"
                vm_function = program_module.lookup_function(name)
                if vm_function is None:
                    raise ProgramLoadError(f"{artifacts.vmfb} has no function {name} that the config lists")
                self.functions[name] = ireert.FunctionInvoker(self.context, self.device, vm_function)
        # Optional companions (Kiln exports): prefill returning only each row's last logits.
        for bs in self.params.prefill_batch_sizes:
            vm_function = program_module.lookup_function(f"prefill_last_bs{bs}")
            if vm_function is not None:
                self.functions[f"prefill_last_bs{bs}"] = ireert.FunctionInvoker(self.context, self.device, vm_function)

    @property
    def cache_dtype(self) -> np.dtype:
        name = self.params.paged_kv_cache.kv_cache_dtype
        if name == "bfloat16":
            import ml_dtypes

            return np.dtype(ml_dtypes.bfloat16)
        return np.dtype(name)

    def allocate_cache(self, pages: int) -> ireert.DeviceArray:
        """The KV cache as one device buffer, zeroed, allocated once."""
        host = np.zeros((pages, self.params.page_elems), dtype=self.cache_dtype)
        return ireert.asdevicearray(self.device, host)

    def invoke(self, name: str, *args) -> list[np.ndarray]:
        """Call `name` and copy its results to host arrays (to_host is a live view)."""
        results = self.functions[name](*args)
        if not isinstance(results, tuple):
            results = (results,)
        return [np.array(r.to_host(), copy=True) for r in results]
