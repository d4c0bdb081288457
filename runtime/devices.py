"""Opening the HAL devices a program runs on, and a KV cache spread over several of them.

A one-device program gets `iree.runtime.get_device(uri)`. A multi-device export
(runtime/device_layout.py) needs `count` distinct devices, in ordinal order: CPU drivers
(local-task, local-sync) make a fresh instance per ordinal, each with its own task workers;
GPU drivers take the driver's first `count` devices, or the devices a comma-separated list
names (`cuda://0,cuda://2`).
"""

from __future__ import annotations

import numpy as np
from iree import runtime as ireert

from .errors import ModelLoadError

CPU_DRIVERS = ("local-task", "local-sync")


def _first_line(error: Exception) -> str:
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def open_devices(uri: str, count: int) -> list[ireert.HalDevice]:
    uris = [part.strip() for part in uri.split(",") if part.strip()]
    if len(uris) > 1 and len(uris) != count:
        raise ModelLoadError(f"{len(uris)} devices were named ({uri}); this export runs on {count}")
    try:
        if count == 1:
            # A GPU device is opened afresh for each program: IREE's CUDA driver makes its context
            # current only on the thread that opens the device, and each service runs its device
            # work on a thread of its own (runtime/executor.py), so a device cached from an
            # earlier service is unusable from the next one's thread. CPU devices are shared.
            return [ireert.get_device(uri, cache=uri.split("://")[0] in CPU_DRIVERS)]
        if len(uris) > 1:
            return [ireert.get_device(part, cache=False) for part in uris]
        driver_name = uri.split("://")[0]
        driver = ireert.get_driver(driver_name)
        if driver_name in CPU_DRIVERS:
            return [driver.create_default_device() for _ in range(count)]
        available = driver.query_available_devices()
        if len(available) < count:
            raise ModelLoadError(f"this export runs on {count} devices; {driver_name} has {len(available)}")
        return [driver.create_device(info) for info in available[:count]]
    except ModelLoadError:
        raise
    except Exception as error:  # iree raises plain ValueError/RuntimeError with long texts
        raise ModelLoadError(f"cannot open device {uri!r}: {_first_line(error)}") from None


class ShardedKvCache:
    """The KV cache of a multi-device program: one buffer per device, [pages, that device's page
    elements]. The runtime hands it around as the one `cache` argument; Program passes its
    buffers in device order, which is how the functions take them."""

    def __init__(self, buffers: list[ireert.DeviceArray]):
        self.buffers = buffers

    @property
    def is_host_accessible(self) -> bool:
        return all(buffer.is_host_accessible for buffer in self.buffers)

    def to_host(self) -> "ShardedPageView":
        return ShardedPageView([buffer.to_host() for buffer in self.buffers])


class ShardedPageView:
    """Whole pages across the devices' host-mapped buffers: page `p` reads as its parts joined in
    device order and writes back split the same way, so a page's bytes move as one page's do."""

    def __init__(self, parts: list[np.ndarray]):
        self.parts = parts
        self.widths = [part.shape[1] for part in parts]
        self.shape = (parts[0].shape[0], sum(self.widths))
        self.dtype = parts[0].dtype

    def __getitem__(self, page: int) -> np.ndarray:
        return np.concatenate([part[page] for part in self.parts])

    def __setitem__(self, page: int, data: np.ndarray) -> None:
        start = 0
        for part, width in zip(self.parts, self.widths):
            part[page] = data[start:start + width]
            start += width
