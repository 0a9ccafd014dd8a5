"""Dense slot indices for the model service's per-sequence state."""

from __future__ import annotations


class SlotAllocator:
    """Dense slot indices for the model service's per-sequence state; lowest free first."""

    def __init__(self, num_slots: int):
        self._free = list(range(num_slots - 1, -1, -1))

    def allocate(self) -> int:
        return self._free.pop()

    def free(self, slot: int) -> None:
        self._free.append(slot)

    @property
    def num_free(self) -> int:
        return len(self._free)
