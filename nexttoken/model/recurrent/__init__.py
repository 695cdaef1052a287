"""The layer kinds that keep a fixed-size state per sequence instead of K/V columns (issue 41), one module each:
LFM2's gated short convolution (short_conv), the gated delta rule of Qwen3.5 / Qwen3-Next (delta_rule), Mamba2's
selective state space (ssd). Each reads its rows' state through `state.slots(layer, batch)` and writes it back with
`state.keep(layer, batch, tensors)` (model/state.py); `STATE_SHAPES[mixer](cfg)` sizes one sequence's state.
Prefill runs the chunked (parallel) form, decode the one-step recurrence; both leave the same state."""

from __future__ import annotations

from typing import Callable

import torch

from ...config import ModelConfig
from .delta_rule import GatedDeltaNet
from .short_conv import ShortConvolution
from .slots import StateSlots, StateSpec

MIXERS = {"convolution": ShortConvolution, "linear_attention": GatedDeltaNet}
# one sequence's state of a layer of each kind: [(shape, dtype or None for the model's)]
STATE_SHAPES: dict[str, Callable[[ModelConfig], list[StateSpec]]] = {k: m.state_shapes for k, m in MIXERS.items()}


def state_specs(cfg: ModelConfig) -> dict[int, list[StateSpec]]:
    """Each recurrent layer's state tensors, by layer index (empty for a model whose layers all keep K/V)."""
    return {i: STATE_SHAPES[cfg.layer(i).mixer](cfg) for i in range(cfg.num_hidden_layers)
            if not cfg.layer(i).keeps_kv}


def state_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """One sequence's recurrent state across all layers, in bytes (the engine's budget counts it per slot)."""
    return sum(torch.Size(shape).numel() * (d or dtype).itemsize
               for specs in state_specs(cfg).values() for shape, d in specs)


__all__ = ["GatedDeltaNet", "MIXERS", "STATE_SHAPES", "ShortConvolution", "StateSlots", "state_bytes",
           "state_specs"]
