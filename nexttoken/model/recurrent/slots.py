"""Recurrent state slots: for each recurrent layer, its state tensors for N sequences, (N, *shape) each, zeroed when
a sequence starts. generate() holds one slot per batch row (model/cache.py's KVCache.states); the engine one per
running sequence (engine/model_runner.py), sized by max_num_seqs."""

from __future__ import annotations

import torch

StateSpec = tuple[tuple[int, ...], "torch.dtype | None"]  # one state tensor of a sequence: shape, dtype (None: model's)


class StateSlots:
    def __init__(self, specs: dict[int, list[StateSpec]], n: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        self.tensors = {layer: [torch.zeros((n, *shape), dtype=d or dtype, device=device) for shape, d in layer_specs]
                        for layer, layer_specs in specs.items()}

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for ts in self.tensors.values() for t in ts)

    def read(self, layer: int, rows: torch.Tensor | slice) -> list[torch.Tensor]:
        """The state of `rows` (B,) slot indices (or a slice): (B, *shape) each."""
        return [t[rows] for t in self.tensors[layer]]

    def write(self, layer: int, rows: torch.Tensor | slice, values: list[torch.Tensor]) -> None:
        for t, v in zip(self.tensors[layer], values):
            t[rows] = v

    def zero(self, rows: list[int]) -> None:
        """A new sequence in each of these slots: its state starts at zero."""
        for ts in self.tensors.values():
            for t in ts:
                t[rows] = 0

    def reorder(self, rows: torch.Tensor) -> None:
        """Slot b takes the state of slot rows[b] (beam search's reorder)."""
        for ts in self.tensors.values():
            for t in ts:
                t.copy_(t[rows])
