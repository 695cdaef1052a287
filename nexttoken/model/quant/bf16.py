"""bfloat16 weights with float32 arithmetic (quantize="bf16"): what llama.cpp runs for a bf16 model.

A bfloat16 *model* (dtype="bfloat16") rounds every activation to bf16, as transformers does, and its decode steps
take the PyTorch modules. Here only the stored weights are bf16: activations, norms, attention and the KV cache
stay float32, so a decode step is the float32 model's fused native step (csrc/decode.cpp) reading half the
bytes, and its tokens are the float32 modules' on the same rounded weights. The kernel widens each bf16 weight
to float32 exactly (a 16-bit shift) and accumulates in float32. It does not use AVX512-BF16's dot product
(vdpbf16ps): that instruction needs the activations rounded to bf16 too, which changes the numbers, and decode is
bound by reading the weights, not by the multiply-adds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from ..native_abi import NtLinear, weight_rows
from . import tiles

class BF16Linear(nn.Module):
    """y = x @ W^T + bias for float32 x with W (N, K) stored as bfloat16 (a plain buffer, widened when used)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.register_buffer("weight", weight)  # (N, K) bfloat16
        self.register_buffer("bias", bias)  # (N,) float32 or None

    @classmethod
    def from_linear(cls, linear: nn.Module) -> "BF16Linear":
        bias = None if linear.bias is None else linear.bias.detach().float()
        return cls(linear.weight.detach().to(torch.bfloat16).contiguous(), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.usable(x, self.weight):  # decode: the bf16 weights streamed once, float32 sums
            return kernels.linear(x, self.weight, self.bias)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # (M, K)
        N = self.out_features
        if x.device.type == "cpu":  # prefill: the stored rows as they are (bf16 GEMM) or widened a block at a time
            y = tiles.matmul(x2, N, lambda n0, n1, dtype, out: self.weight[n0:n1].to(dtype))
        else:
            y = F.linear(x2, self.weight.to(x.dtype))
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.view(*lead, N)

    def native(self) -> NtLinear | None:
        """The kernels' description (native_abi.describe): bfloat16 rows, widened exactly."""
        return weight_rows(self.weight, self.bias)


class TableEmbedding(nn.Module):
    """Embedding rows read from a weight-only layer's matrix (`table`; a tied LM head shares it), returned as
    float32: the base of BF16Embedding and ggml.GGUFEmbedding."""

    def __init__(self, table: nn.Module) -> None:
        super().__init__()
        self.table = table

    @property
    def weight(self) -> torch.Tensor:  # the model's dtype/device are read from embed.weight: float32
        return torch.empty(0, dtype=torch.float32, device=self.table.weight.device)


class BF16Embedding(TableEmbedding):
    """Embedding rows read from a BF16Linear's weights (tied embeddings share them), returned as float32."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.table.weight).to(torch.float32)  # (B, T, C)

    def native_table(self) -> NtLinear | None:
        """The token table as csrc/decode.cpp's embed reads it: bfloat16 rows (native_abi.describe_table)."""
        w = self.table.weight
        return weight_rows(w) if w.dtype == torch.bfloat16 else None
