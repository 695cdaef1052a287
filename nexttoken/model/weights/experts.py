"""MoE experts kept as a file stores them: each kept expert's gate/up (w13) and down (w2) replaced by a packed
layer, its float biases kept. Shared by the GGUF reader (gguf_packed.py: MXFP4 and ggml blocks) and the folder
reader (loader.py: a released gpt-oss checkpoint's MXFP4 experts)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ...config import ModelConfig
from ...families import family
from ..quant.mxfp4 import Mxfp4Linear

# rows_of(checkpoint name) -> (rows, GGUF type name); make(parts, the float layer replaced) -> the packed layer
Rows = Callable[[str], tuple[torch.Tensor, str]]
Make = Callable[[list[tuple[torch.Tensor, str]], nn.Module], nn.Module]


def keep_experts(model: nn.Module, cfg: ModelConfig, kept: set[str] | dict, rows_of: Rows, make: Make) -> None:
    """Replace every expert whose gate weight's checkpoint name is in `kept`: w13 from its gate and up rows, w2
    from its down rows."""
    if not kept:
        return
    gate, up, down = family(cfg.architecture).expert_names
    for i, block in enumerate(model.layers):
        prefix = f"model.layers.{i}.{family(cfg.architecture).moe_prefix}experts."
        if f"{prefix}0.{gate}.weight" not in kept:
            continue
        for e, mlp in enumerate(block.mlp.experts):
            x = f"{prefix}{e}."
            mlp.w13 = make([rows_of(x + gate + ".weight"), rows_of(x + up + ".weight")], mlp.w13)
            mlp.w2 = make([rows_of(x + down + ".weight")], mlp.w2)


def mxfp4_layer(parts: list[tuple[torch.Tensor, str]], old: nn.Module) -> Mxfp4Linear:
    """MXFP4 row ranges stacked into one Mxfp4Linear, the replaced layer's bias kept."""
    rows = parts[0][0] if len(parts) == 1 else torch.cat([p for p, _ in parts])
    return Mxfp4Linear(rows, old.in_features, None if old.bias is None else old.bias.detach())
