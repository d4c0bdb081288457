"""A checkpoint's tensors made from the file when asked for, one at a time, and not kept.

A GGUF's weights dequantized to float32 all at once are four to eight times the file (6 GB for a
1.5B Q4_K_M model, 32 GB at 8B): the export asks for each weight as it places it in the model
(export/export_model.py), which then holds it quantized, so only one float32 weight is alive at a
time, and a weight served from its own blocks is never dequantized at all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from functools import partial
from typing import Any


class LazyArrays(Mapping):
    """Name -> value, each made by its maker on every access (the caller keeps what it needs);
    each one's shape and kind (a block type's name, for stored blocks) known without making it."""

    def __init__(self):
        self._makers: dict[str, Callable[[], Any]] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._kinds: dict[str, str] = {}

    def add(self, name: str, shape: tuple[int, ...], make: Callable[[], Any], kind: str = "") -> None:
        self._makers[name] = make
        self._shapes[name] = tuple(shape)
        self._kinds[name] = kind

    def add_from(self, source: LazyArrays, name: str, as_name: str = "") -> None:
        """source[name], under `as_name` (else its own), made from source when asked for."""
        self.add(as_name or name, source.shape(name), partial(source.__getitem__, name), source.kind(name))

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def kind(self, name: str) -> str:
        return self._kinds[name]

    def __getitem__(self, name: str) -> Any:
        return self._makers[name]()

    def __contains__(self, name: object) -> bool:  # Mapping's own asks for the value
        return name in self._makers

    def __iter__(self) -> Iterator[str]:
        return iter(self._makers)

    def __len__(self) -> int:
        return len(self._makers)


def shape_of(arrays: Mapping, name: str) -> tuple[int, ...]:
    """The shape of arrays[name], without making it where the arrays are lazy."""
    return arrays.shape(name) if isinstance(arrays, LazyArrays) else tuple(arrays[name].shape)


def lazy(arrays: Mapping) -> LazyArrays:
    """`arrays` as LazyArrays (itself if it is): a dict's values handed out as they are."""
    if isinstance(arrays, LazyArrays):
        return arrays
    out = LazyArrays()
    for name in arrays:
        out.add(name, tuple(arrays[name].shape), partial(arrays.__getitem__, name))
    return out


def renamed(arrays: Mapping, name_of: Callable[[str], str]) -> LazyArrays:
    """`arrays` under new names, each made only when asked for by its new name."""
    arrays, out = lazy(arrays), LazyArrays()
    for name in arrays:
        out.add_from(arrays, name, name_of(name))
    return out


def rows(arrays: Mapping, name: str, begin: int, end: int) -> Callable[[], Any]:
    """A maker of rows begin:end of arrays[name] (a fused weight's part)."""
    return lambda: arrays[name][begin:end]
