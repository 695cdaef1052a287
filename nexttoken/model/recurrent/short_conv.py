"""LFM2's gated short convolution (transformers' Lfm2ShortConv): in_proj to three parts B, C, x; the causal
depthwise convolution of B * x over the last `conv_L_cache` inputs; C times it; out_proj. Its state per sequence is
the window of the last K - 1 values of B * x."""

from __future__ import annotations

import torch
from torch import nn

from ...config import ModelConfig
from ..batch import ForwardBatch
from ..linear import Linear
from ..state import SequenceState
from .conv import causal_conv, masked


class ShortConvolution(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        rec, C = cfg.recurrent, cfg.hidden_size
        assert rec is not None
        self.layer, self.kind = layer, cfg.layer(layer)
        self.wi = Linear(C, 3 * C, bias=rec.conv_bias)  # in_proj: [B; C; x]
        self.conv = nn.Parameter(torch.empty(C, 1, rec.conv_kernel))  # (C, 1, K) depthwise
        self.conv_bias = nn.Parameter(torch.empty(C)) if rec.conv_bias else None
        self.wo = Linear(C, C, bias=rec.conv_bias)

    @staticmethod
    def state_shapes(cfg: ModelConfig) -> list:
        assert cfg.recurrent is not None
        return [((cfg.hidden_size, cfg.recurrent.conv_kernel - 1), None)]  # the window of B * x

    @staticmethod
    def checkpoint(cfg: ModelConfig, layer: int) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
        """Our tensors under layers.{layer}.attention -> the checkpoint tensors (name, shape) joined along dim 0."""
        assert cfg.recurrent is not None
        C, K, p = cfg.hidden_size, cfg.recurrent.conv_kernel, f"model.layers.{layer}.conv."
        out = {"wi.weight": [(p + "in_proj.weight", (3 * C, C))], "conv": [(p + "conv.weight", (C, 1, K))],
               "wo.weight": [(p + "out_proj.weight", (C, C))]}
        if cfg.recurrent.conv_bias:
            out |= {"wi.bias": [(p + "in_proj.bias", (3 * C,))], "conv_bias": [(p + "conv.bias", (C,))],
                    "wo.bias": [(p + "out_proj.bias", (C,))]}
        return out

    def forward(self, x: torch.Tensor, batch: ForwardBatch, state: SequenceState, cos: torch.Tensor | None,
                sin: torch.Tensor | None) -> torch.Tensor:
        b, c, h = self.wi(masked(x, batch)).transpose(1, 2).chunk(3, dim=1)  # (B, C, T) each
        (window,) = state.slots(self.layer, batch)
        y, window = causal_conv(b * h, window, self.conv, self.conv_bias)
        state.keep(self.layer, batch, [window])
        return self.wo((c * y).transpose(1, 2))  # (B, T, C)
