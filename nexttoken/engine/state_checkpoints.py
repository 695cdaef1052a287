"""Recurrent-state checkpoints for the prefix cache of hybrid models (issue 41), as vLLM's hybrid KV cache manager
and SGLang's MambaRadixCache keep them: a cached prefix's K/V blocks say nothing of the state a recurrent layer
holds after it, so where a whole prompt chunk is computed (the place a later prompt's hit can end: hits are cut to
whole chunks) the sequence's state slot is copied here under the key of the chunk's last block. A hit restores it
into the new sequence's slot, and the chunks after it run exactly as they ran for the first sequence, so a hit
gives the bits of a miss.

Up to `capacity` checkpoints of one sequence's state each (their bytes are reserved beside the state slots before
the KV pool is sized), the least recently used dropped first. A prefix whose checkpoint is gone is not a hit
(block_manager.BlockManager.match asks `has`)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable

import torch

from ..model.recurrent import StateSlots
from ..model.recurrent.slots import StateSpec


class StateCheckpoints:
    def __init__(self, specs: dict[int, list[StateSpec]], capacity: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        self.capacity = capacity
        self.store = StateSlots(specs, capacity, dtype, device)  # (capacity, *shape) per state tensor
        self._at: OrderedDict[Hashable, int] = OrderedDict()  # key -> checkpoint row, least recently used first
        self._free = list(range(capacity))

    @property
    def nbytes(self) -> int:
        return self.store.nbytes

    def __len__(self) -> int:
        return len(self._at)

    def has(self, key: Hashable) -> bool:
        return key in self._at

    def save(self, key: Hashable, states: StateSlots, slot: int) -> None:
        """Copy slot `slot` of `states` (a sequence's state right after the prefix `key` names) under `key`."""
        if key in self._at:  # the same prefix computed again: the same bits (chunks are computed alike)
            self._at.move_to_end(key)
            return
        if not self._free:
            _, row = self._at.popitem(last=False)
            self._free.append(row)
        row = self._free.pop()
        self._copy(states, slot, self.store, row)
        self._at[key] = row

    def restore(self, key: Hashable, states: StateSlots, slot: int) -> None:
        """Slot `slot` of `states` takes the state saved under `key` (which must be there: `has`)."""
        row = self._at[key]
        self._at.move_to_end(key)
        self._copy(self.store, row, states, slot)

    @staticmethod
    def _copy(src: StateSlots, src_row: int, dst: StateSlots, dst_row: int) -> None:
        for layer in src.tensors:
            dst.write(layer, slice(dst_row, dst_row + 1), src.read(layer, slice(src_row, src_row + 1)))
