"""Which adapter each of a build's LoRA slots holds (vLLM's --max-loras, S-LoRA's adapter slots).

Slot 0 holds none: a row there is the base model. A request holds its adapter's slot while it
runs (`hold` / `release`); an adapter not in a slot is given a free one, else the least recently
used that no request holds, whose adapter is then out of the slots (it is read again when asked
for). Plain bookkeeping: writing the weights is weights.py's.
"""

from __future__ import annotations

from ..errors import QueueFullError


class LoraSlots:
    def __init__(self, count: int):
        if count < 1:
            raise ValueError(f"a LoRA build needs at least one adapter slot, got {count}")
        self.count = count
        self._slot_of: dict[str, int] = {}
        self._holders: dict[int, int] = {}  # slot -> requests running with it
        self._last_used: dict[int, int] = {}
        self._clock = 0

    def slot_of(self, name: str) -> int | None:
        return self._slot_of.get(name)

    @property
    def resident(self) -> dict[str, int]:
        return dict(self._slot_of)

    def place(self, name: str) -> tuple[int, str | None]:
        """A slot for `name`, which is not in one: a free slot, else the least recently used one no
        request holds; and the adapter that slot held (None if free). QueueFullError when every
        slot is held by a running request (the caller retries once one ends)."""
        if name in self._slot_of:
            raise ValueError(f"adapter {name!r} is already in slot {self._slot_of[name]}")
        taken = set(self._slot_of.values())
        free = next((slot for slot in range(1, self.count + 1) if slot not in taken), None)
        evicted = None
        if free is None:
            idle = [slot for slot in taken if not self._holders.get(slot)]
            if not idle:
                raise QueueFullError(f"all {self.count} LoRA slots hold adapters that running requests use: "
                                     "retry shortly, or start the server with a larger --max-loras")
            free = min(idle, key=lambda slot: self._last_used.get(slot, 0))
            evicted = next(other for other, slot in self._slot_of.items() if slot == free)
            del self._slot_of[evicted]
        self._slot_of[name] = free
        self._touch(free)
        return free, evicted

    def hold(self, name: str) -> int:
        """The slot of `name` (which is in one), held until `release`."""
        slot = self._slot_of[name]
        self._holders[slot] = self._holders.get(slot, 0) + 1
        self._touch(slot)
        return slot

    def release(self, name: str) -> None:
        slot = self._slot_of.get(name)
        if slot is not None and self._holders.get(slot):
            self._holders[slot] -= 1

    def remove(self, name: str) -> int | None:
        """Take `name` out of its slot (an unload); the slot it left, None if it held none.
        A slot a running request holds is not taken: ValueError."""
        slot = self._slot_of.get(name)
        if slot is None:
            return None
        if self._holders.get(slot):
            raise ValueError(f"adapter {name!r} is in use by {self._holders[slot]} running request(s)")
        del self._slot_of[name]
        return slot

    def _touch(self, slot: int) -> None:
        self._clock += 1
        self._last_used[slot] = self._clock
