"""The per-sequence state a forward hands the layers: one abstraction whatever the layer kind keeps.

Each layer kind (families/base.py's LayerKind, one module per kind: layers.Attention today) states what it reads and
writes of its rows' state, through this protocol and nothing else:

- attention (`LayerKind.keeps_kv`): `update(layer, batch, k, v)` stores the new columns' keys and values at the
  batch's write columns and returns the columns the rows may attend, (B, Hkv, S, D) each. Implementations: the slot
  cache of one generation (cache.KVCache), and the engine's views of its paged pool (engine/model_runner.py's
  SeqView / RowsView / SlotView over cache.PagedKVCache's blocks).
- the recurrent kinds of issue 41 (linear attention, short convolution, state space: model/recurrent/) keep a
  fixed-size state per sequence instead: `slots(layer, batch)` gives their rows' state tensors (B, *state shape)
  each, and `keep(layer, batch, tensors)` stores the state after the new tokens. Sized from the config
  (recurrent.state_specs), held by generate()'s KVCache (`states`) and by the engine beside the pool, one slot per
  running sequence (LayerKind.keeps_kv tells them which layers need which). A state without these methods serves
  models whose layers all keep K/V, so nothing above changes for them.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .batch import ForwardBatch


class SequenceState(Protocol):
    """What the layers of one forward read and write of their rows' sequences (see the module docstring)."""

    def update(self, layer: int, batch: ForwardBatch, k: torch.Tensor,
               v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, Hkv, T, D) at the batch's columns; return the readable span (B, Hkv, S, D) each."""

    def slots(self, layer: int, batch: ForwardBatch) -> list[torch.Tensor]:
        """A recurrent layer's state of the batch's rows before the new tokens, (B, *shape) each."""

    def keep(self, layer: int, batch: ForwardBatch, state: list[torch.Tensor]) -> None:
        """Store a recurrent layer's state after the new tokens, (B, *shape) each, for the batch's rows."""
