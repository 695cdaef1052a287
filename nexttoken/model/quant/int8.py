"""Weight-only int8: `Int8Linear` holds int8 weights with one float32 scale per output row (symmetric per-row
quantization, `quantize_rows`), and `Int8Embedding` reads embedding rows from such a table (tied embeddings share
it). Built by quant.quantize_int8.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from ..arithmetic import Arithmetic
from ..native_abi import Kind, NtLinear, weight_rows
from . import tiles


class Int8Linear(nn.Module):
    """y = (x @ q^T) * scale + bias with q (N, K) int8 and scale (N,) float32: symmetric per-row quantization."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = qweight.shape[1], qweight.shape[0]
        self.register_buffer("weight", qweight)  # (N, K) int8
        self.register_buffer("scale", scale)  # (N,) float32
        self.register_buffer("bias", bias)  # (N,) float32 or None
        self.activations = Arithmetic.quantized_activations  # the policy's default: "float32", exact

    def use_arithmetic(self, policy: Arithmetic) -> None:
        """A model's policy: quantized_activations "float32" (exact) or "integer" (int16 per row at decode)."""
        self.activations = policy.quantized_activations

    @property
    def kind(self) -> int:
        """nt_abi.h's NtKind of this layer's decode product: int8 rows with float32 or int16 activations."""
        return int(Kind.W_I8_F32 if getattr(self, "activations", "float32") == "float32" else Kind.W_I8)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        q, scale = quantize_rows(linear.weight.detach())
        bias = None if linear.bias is None else linear.bias.detach().float()
        return cls(q, scale, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.usable(x, self.weight):
            return kernels.linear(x, self.weight, self.bias, self.scale, kind=self.kind)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # (M, K)
        # torch's own int8 weight-only kernel for few rows; past the native kernel's rows dequantizing in blocks is
        # far faster where the kernels exist (40 x 512 -> 512, one thread: 15 ms vs 0.5 ms; MoE experts' prefill)
        few = x2.shape[0] <= 64 and (x2.shape[0] <= kernels.MAX_ROWS or not kernels.available())
        if x.device.type == "cpu" and few:
            y = torch.ops.aten._weight_int8pack_mm(x2.contiguous(), self.weight, self.scale.to(x.dtype))
        elif x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and kernels.available():
            y = self._prefill_in_blocks(x2)
        else:  # dequantizing once costs less than the GEMM it feeds, which then runs at full speed
            y = F.linear(x2, (self.weight.to(torch.float32) * self.scale[:, None]).to(x.dtype))
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.view(*lead, self.out_features)

    def _prefill_in_blocks(self, x: torch.Tensor) -> torch.Tensor:
        """x (M, K) @ dequantized weights^T, a block of output rows at a time (quant/tiles.py)."""
        return tiles.matmul(x, self.out_features, lambda n0, n1, dtype, out: kernels.dequantize(
            self.weight[n0:n1], self.scale[n0:n1], dtype, out=out))

    def native(self) -> NtLinear | None:
        """The kernels' description (native_abi.describe): int8 rows and their float32 scales."""
        if self.weight.dtype != torch.int8 or not self.weight.is_contiguous():
            return None
        return weight_rows(self.weight, self.bias, self.scale, kind=self.kind)


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) float -> (int8 (N, K), scale (N,) float32) with w ~= q * scale[:, None], |q| <= 127."""
    wf = w.float()
    scale = wf.abs().amax(dim=1).clamp(min=1e-12) / 127.0  # (N,)
    q = torch.round(wf / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


class Int8Embedding(nn.Module):
    """Embedding rows read from an Int8Linear's weights (tied embeddings share the quantized table)."""

    def __init__(self, table: Int8Linear, dtype: torch.dtype) -> None:
        super().__init__()
        self.table, self.dtype = table, dtype

    @property
    def weight(self) -> torch.Tensor:  # the model's dtype/device are read from embed.weight
        return torch.empty(0, dtype=self.dtype, device=self.table.weight.device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(ids, self.table.weight).to(torch.float32)  # (B, T, C)
        return (rows * self.table.scale[ids][..., None]).to(self.dtype)

    def native_table(self) -> NtLinear | None:
        """The token table as csrc/decode.cpp's embed reads it: int8 rows times their scales, for a float32 model
        (native_abi.describe_table)."""
        w = self.table.weight
        return weight_rows(w, scale=self.table.scale) if w.dtype == torch.int8 and self.dtype == torch.float32 else None
