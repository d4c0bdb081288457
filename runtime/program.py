"""Load a compiled model (VMFB + IRPA parameters) on a HAL device and call its functions.

This is the only place that talks to iree.runtime's module machinery. It finds the
functions the contract names and nothing about requests or pages.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from iree import runtime as ireert

from .config import KilnParams, kv_page_elems, kv_storage_dtype, kv_storage_elems, load_model_config
from .contract import PARAMETER_SCOPE, Artifacts, Capabilities, ContractError, parse_function_name
from .device_layout import DeviceLayout
from .devices import ShardedKvCache, open_devices
from .errors import ModelLoadError
from .parameters import ParameterArchive, resolved


def quiet_exit() -> None:
    """Let a process that holds its programs until it ends exit without nanobind listing every IREE
    object still alive then as "leaked" (a `kiln serve` stopped by Ctrl-C: some 140 lines). The
    process's end frees them; the check is for the bindings' own developers."""
    from iree._runtime_libs import _runtime

    if hasattr(_runtime, "disable_leak_checker"):
        _runtime.disable_leak_checker()


class Program:
    """The compiled functions of one model on its device (or devices: a tensor/pipeline-parallel
    export's, runtime/device_layout.py), its config and what it can do."""

    def __init__(self, artifacts: Artifacts, device: str = "local-task", parameter_memory: str = "auto"):
        """`parameter_memory`: where the parameters live in host memory (runtime/parameters.py)."""
        for label, path in (("VMFB", artifacts.vmfb), ("parameters", artifacts.params), ("config", artifacts.config)):
            if not Path(path).is_file():
                raise ModelLoadError(f"{label} file {path} does not exist")
        try:
            self.params, kiln = load_model_config(artifacts.config)
        except (ValueError, TypeError, KeyError) as error:
            raise ModelLoadError(f"model config {artifacts.config} is invalid: {error}") from None
        self.kiln = kiln or KilnParams()
        parameter_memory = resolved(parameter_memory, device)
        self.layout = DeviceLayout(self.kiln.tensor_parallel, self.kiln.pipeline_parallel)
        self.devices = open_devices(device, self.layout.device_count)
        self.device = self.devices[0]  # where the request's arrays go and the logits come from
        instance = ireert.VmInstance()
        try:
            self.parameters = ParameterArchive(artifacts.params, parameter_memory)
            params_module = ireert.create_io_parameters_module(instance, self.parameters.provider(PARAMETER_SCOPE))
            hal_module = ireert.create_hal_module(instance, devices=self.devices)
            program_module = ireert.VmModule.mmap(instance, str(artifacts.vmfb))
            context = ireert.VmContext(instance, modules=[hal_module, params_module, program_module])
        except Exception as error:
            raise ModelLoadError(f"cannot load {artifacts.vmfb} with {artifacts.params}: {str(error).splitlines()[0]}") from None
        self.functions: dict[str, ireert.FunctionInvoker] = {}
        for name in program_module.function_names:
            if parse_function_name(name) is not None:
                vm_function = program_module.lookup_function(name)
                self.functions[name] = ireert.FunctionInvoker(context, self.device, vm_function)
        try:
            self.capabilities = Capabilities.of(self.params, self.kiln, self.functions)
        except ContractError as error:
            raise ModelLoadError(f"{artifacts.vmfb} does not fit {artifacts.config}: {error}") from None

    @property
    def cache_dtype(self) -> np.dtype:
        """The element type of the cache's buffer (an int8 cache's storage type: config.kv_storage_dtype)."""
        name = kv_storage_dtype(self.params.paged_kv_cache.kv_cache_dtype)
        if name == "bfloat16":
            import ml_dtypes

            return np.dtype(ml_dtypes.bfloat16)
        return np.dtype(name)

    @property
    def page_elems(self) -> int:
        """Elements (of cache_dtype) in one page of the cache's buffer: every layer's block, or one
        group's for a model with page groups (config.PageGroups)."""
        groups = self.capabilities.page_groups
        if groups is None:
            return self.params.page_elems
        kv, p = self.params.paged_kv_cache, self.params
        elems = kv_page_elems(groups.layers_per_page, kv.attention_head_count_kv, p.attn_head_dim,
                              kv.block_seq_stride, kv.kv_cache_dtype)
        return kv_storage_elems(elems, kv.kv_cache_dtype)

    @property
    def block_elems(self) -> int:
        """Elements one block of a sequence takes in the cache: a page in every group."""
        groups = self.capabilities.page_groups
        return self.page_elems * (groups.count if groups else 1)

    def allocate_cache(self, pages: int) -> ireert.DeviceArray | ShardedKvCache:
        """The KV cache, zeroed, allocated once: one device buffer, or one on each device."""
        if self.layout.device_count == 1:
            return ireert.asdevicearray(self.device, np.zeros((pages, self.page_elems), dtype=self.cache_dtype))
        p = self.params
        dtype = p.paged_kv_cache.kv_cache_dtype
        widths = [kv_storage_elems(width, dtype) for width in
                  self.layout.page_elems(p.transformer_block_count, p.paged_kv_cache.attention_head_count_kv,
                                         p.block_seq_stride, p.attn_head_dim, dtype)]
        return ShardedKvCache([ireert.asdevicearray(device, np.zeros((pages, width), dtype=self.cache_dtype))
                               for device, width in zip(self.devices, widths)])

    def device_array(self, array: np.ndarray) -> ireert.DeviceArray:
        """A host array copied to the (first) device: arguments the runtime keeps, such as a LoRA
        build's stacked adapter weights."""
        return ireert.asdevicearray(self.device, array)

    @staticmethod
    def _arguments(args) -> list:
        """The call's arguments with a sharded cache spread into its buffers, in device order."""
        return [part for arg in args for part in (arg.buffers if isinstance(arg, ShardedKvCache) else (arg,))]

    def call(self, name: str, *args) -> np.ndarray:
        """Call `name`; its one result as a live host view (valid until the next call)."""
        return self.functions[name](*self._arguments(args)).to_host()

    def call_sampled(self, name: str, args: tuple, sample: str, sample_args: tuple) -> np.ndarray:
        """Call `name`, then `sample` on its logits where they lie (the device) with its own
        arrays: the token ids come back to the host, not the logits."""
        logits = self.functions[name](*self._arguments(args))
        return np.array(self.functions[sample](logits, *sample_args).to_host(), copy=True)

    def invoke(self, name: str, *args) -> list[np.ndarray]:
        """Call `name` and copy its results to host arrays."""
        results = self.functions[name](*self._arguments(args))
        if not isinstance(results, tuple):
            results = (results,)
        return [np.array(r.to_host(), copy=True) for r in results]
