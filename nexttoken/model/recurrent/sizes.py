"""What one sequence's recurrent state is, per layer, from the config: the layer kinds' state_shapes."""

from __future__ import annotations

from typing import Callable

import torch

from ...config import ModelConfig
from .delta_rule import GatedDeltaNet
from .short_conv import ShortConvolution
from .slots import StateSpec
from .ssd import Mamba2Mixer

MIXERS = {"convolution": ShortConvolution, "linear_attention": GatedDeltaNet, "state_space": Mamba2Mixer}
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
