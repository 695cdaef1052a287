"""MXFP4 weights kept as stored (gpt-oss's experts; GGUF type MXFP4): `Mxfp4Linear` multiplies ggml's MXFP4 blocks
natively (csrc/mxfp4.cpp: float32 activations, exact weights) for decode-sized inputs and through dequantized tiles
for prefill (quant/tiles.py), with a torch dequantizer where the kernels do not run.

A row of W is K / 32 blocks of 17 bytes: an E8M0 exponent byte e, then 16 bytes of E2M1 codes, element j in the low
nibble of byte j and element j + 16 in its high nibble; w = E2M1(code) * 2^(e - 127) (ggml-common.h's block_mxfp4,
gguf-py's quants.MXFP4). Every such value is exact in float32 (and in bfloat16), so the dequantized matrix is the
checkpoint's exactly, and the kept layer computes the float model's product up to the order of the sums.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from ..native_abi import Kind, NtLinear, weight_rows
from . import tiles

BLOCK, BYTES = 32, 17
GGML_TYPE = 39  # ggml.h's GGML_TYPE_MXFP4 (gguf's GGMLQuantizationType.MXFP4)
KVALUES = (0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 0.0, -1.0, -2.0, -3.0, -4.0, -6.0, -8.0, -12.0)  # E2M1 x 2


def dequantize_reference(rows: torch.Tensor, K: int) -> torch.Tensor:
    """MXFP4 rows (N, K / 32 * 17) uint8 -> (N, K) float32 in torch, gguf's formula step by step: the doubled E2M1
    value times ggml_e8m0_to_fp32_half(e) = 2^(e - 128) built from its float32 bits (subnormal for e < 2)."""
    N = rows.shape[0]
    blocks = rows.reshape(N, K // BLOCK, BYTES)
    e = blocks[..., 0].to(torch.int32)  # (N, G)
    bits = torch.where(e < 2, torch.tensor(0x00200000, dtype=torch.int32) << e, (e - 1) << 23)
    half = bits.view(torch.float32)  # (N, G)
    qs = blocks[..., 1:].to(torch.int64)  # (N, G, 16)
    codes = torch.cat((qs & 0x0F, qs >> 4), dim=-1)  # (N, G, 32): elements 0-15, then 16-31
    values = torch.tensor(KVALUES, dtype=torch.float32, device=rows.device)[codes]
    return (values * half[..., None]).reshape(N, K)


def dequantize(rows: torch.Tensor, K: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """(N, K) float32 of MXFP4 rows: the native kernel where it runs, else the torch reference (the same values)."""
    if rows.device.type == "cpu" and kernels.mxfp4_available():
        return kernels.dequantize_mxfp4(rows.contiguous(), K, out=out)
    return dequantize_reference(rows, K)


class Mxfp4Linear(nn.Module):
    """y = x @ W^T + bias with W (N, K) as MXFP4 blocks: weight (N, K / 32 * 17) uint8, bias (N,) float32 or None."""

    def __init__(self, rows: torch.Tensor, in_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        if rows.dtype != torch.uint8 or in_features % BLOCK or rows.shape[-1] != in_features // BLOCK * BYTES:
            raise ValueError(f"MXFP4 rows {tuple(rows.shape)} {rows.dtype} do not hold {in_features} columns "
                             f"({in_features // BLOCK} blocks of {BYTES} bytes a row)")
        self.in_features, self.out_features = in_features, int(rows.shape[0])
        self.register_buffer("weight", rows.contiguous())
        self.register_buffer("bias", bias)

    def dequantized(self) -> torch.Tensor:
        """(N, K) float32: the stored values exactly."""
        return dequantize(self.weight, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, K = x.shape[:-1], self.in_features
        x2 = x.reshape(-1, K)  # (M, K)
        native = x.device.type == "cpu" and not torch.is_grad_enabled() and kernels.mxfp4_available()
        if native and x2.shape[0] <= kernels.MAX_ROWS and x.dtype in (torch.float32, torch.bfloat16):
            return kernels.linear_mxfp4(x2, self.weight, K, self.bias).view(*lead, self.out_features)
        if not native:  # the reference: exact weights, torch's product
            return F.linear(x2, self.dequantized().to(x.dtype), self.bias).view(*lead, self.out_features)
        # prefill: a cache-sized block of rows dequantized at a time (the values are exact in bf16 too)
        y = tiles.matmul(x2, self.out_features, lambda a, b, dtype, out: dequantize(
            self.weight[a:b], K, out=out if dtype == torch.float32 else None).to(dtype))
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.view(*lead, self.out_features)

    def native(self) -> NtLinear | None:
        """The kernels' description (native_abi.describe): W_GGML + ggml's MXFP4 type (39), which csrc/ggml.cpp
        hands to csrc/mxfp4.cpp's product, so the fused decode step reads the experts as stored."""
        return weight_rows(self.weight, self.bias, kind=int(Kind.W_GGML) + GGML_TYPE) if kernels.mxfp4_available() \
            else None

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, blocks=MXFP4"
