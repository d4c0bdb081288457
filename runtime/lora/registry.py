"""The adapters a server knows, by name, and the build's slots they take turns in.

An adapter is read and checked once, when it is loaded (`--lora NAME=PATH`, or the load route), and
kept in host memory; it takes a slot when a request asks for it (`hold`), writing its weights into
the stacked arrays the device holds, and keeps it while any request runs with it. The device's
copy is replaced whole (`upload`, on the device's thread, so between model calls).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..contract import Capabilities
from ..errors import InvalidRequestError, ModelNotFoundError
from .adapter import LoraAdapter, LoraShapes, read_adapter
from .slots import LoraSlots
from .weights import StackedLoraWeights

# A loaded adapter's tokens are keyed in the prefix cache with its id in the bits above any token
# id, so no two adapters (nor an adapter and the base model) share K/V.
_SALT_SHIFT = 32


@dataclass(frozen=True)
class AdapterHold:
    """A request's hold on its adapter's slot, let go (`release`) when the request ends."""

    name: str
    slot: int
    cache_salt: int
    release: Callable[[], None]


class LoraRegistry:
    def __init__(self, abi: Capabilities, upload: Callable[[list[np.ndarray]], Awaitable[None]]):
        self.shapes = LoraShapes(abi.lora_layers, abi.lora_rank, {name: (fin, fout) for name, fin, fout in
                                                                   abi.lora_modules})
        self.adapters: dict[str, LoraAdapter] = {}
        self.slots = LoraSlots(abi.lora_slots)
        self.weights = StackedLoraWeights(self.shapes, abi.lora_slots)
        self._upload = upload
        self._ids = itertools.count(1)
        self._salts: dict[str, int] = {}
        self._placing = asyncio.Lock()

    def stacked(self) -> list[np.ndarray]:
        """The arrays the functions take, A then B per module, in the build's order."""
        return [array for module in self.shapes.modules for array in (self.weights.a[module], self.weights.b[module])]

    def load(self, name: str, path: str | Path) -> LoraAdapter:
        """Read and check an adapter under `name` (a 400 for one that does not fit, or a name taken)."""
        if not name or not isinstance(name, str):
            raise InvalidRequestError("lora_name must be a non-empty string", param="lora_name")
        if name in self.adapters:
            raise InvalidRequestError(f"a LoRA adapter named {name!r} is already loaded", param="lora_name")
        adapter = read_adapter(name, path, self.shapes)
        self.adapters[name] = adapter
        self._salts[name] = next(self._ids) << _SALT_SHIFT
        return adapter

    def unload(self, name: str) -> None:
        """Forget an adapter: a 404 for an unknown one, a 400 while requests run with it."""
        if name not in self.adapters:
            raise ModelNotFoundError(f"no LoRA adapter named {name!r} is loaded", param="lora_name")
        try:
            self.slots.remove(name)
        except ValueError as error:
            raise InvalidRequestError(f"LoRA adapter {name!r} cannot be unloaded now: {error}",
                                      param="lora_name") from None
        del self.adapters[name], self._salts[name]

    async def hold(self, name: str) -> AdapterHold:
        """`name`'s slot, held for one request: placed first (its weights written and uploaded)
        if it is in none."""
        if name not in self.adapters:
            raise ModelNotFoundError(f"no LoRA adapter named {name!r} is loaded", param="model")
        async with self._placing:
            if self.slots.slot_of(name) is None:
                slot, _ = self.slots.place(name)
                self.weights.write(slot, self.adapters[name])
                await self._upload(self.stacked())
            slot = self.slots.hold(name)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.slots.release(name)

        return AdapterHold(name, slot, self._salts[name], release)
