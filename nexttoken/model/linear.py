"""Linear layers that take the native weight-streaming kernel for decode-sized inputs, torch's GEMM otherwise.

`Linear` is a drop-in nn.Linear (same parameters, same state dict); `KeptLinear` is one quantization leaves alone.
The quantized layers are in quant/.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels
from .native_abi import NtLinear, weight_rows


class Linear(nn.Linear):
    """nn.Linear whose few-row products (decode steps) stream the weights through the native kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.usable(x, self.weight):
            bias = None if self.bias is None else self.bias.float()
            return kernels.linear(x, self.weight, bias)
        return F.linear(x, self.weight, self.bias)

    def native(self) -> NtLinear | None:
        """The kernels' description (native_abi.describe): float32 or bfloat16 rows, a float32 bias."""
        return weight_rows(self.weight, self.bias)


class KeptLinear(nn.Linear):
    """A Linear that quantization leaves in its float dtype (MoE routers: their top-k choice is discrete), with
    the same native few-row products, so a row's numbers never depend on how many rows share the call."""

    forward = Linear.forward

    def native(self) -> NtLinear | None:
        """As a MoE router or shared-expert gate (csrc/decode.cpp reads them so): float32 rows, and a float32 bias
        (gpt-oss's router) added by the product as the forward's kernel adds it."""
        if self.weight.dtype != torch.float32:
            return None
        return weight_rows(self.weight, self.bias)
