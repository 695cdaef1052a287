"""4-bit weight-only linear layers: groups of 32 columns with one float16 scale each (llama.cpp's Q4_0 scheme).

Each group's scale is d = f * m / -8, m its value of largest magnitude (Q4_0 takes f = 1: that value is then
exactly -8 * d) and f the one of a few factors <= 1 that gives the group the least squared error; the values
round to q in [-8, 7]: w ~= q * d. A weight then costs 4.5 bits (4 + 16/32), a quarter of bf16's bytes
plus the scales, and decode (bound by reading the weights) runs that much faster in the native kernel
(csrc/int4.cpp). Prefill dequantizes blocks of rows and runs torch's GEMM on them, as the int8 layer does.

The decode kernel by default widens each chunk's weights to float32 in registers and multiplies them with the
float32 activations (nt_linear_i4f: exactly the dequantized weights' float32 product). The model's arithmetic
policy `quantized_activations="integer"` takes the faster, inexact path instead: int8 activations per group of 32
columns (quantize_activations: llama.cpp's Q8_0 scheme) with VNNI's vpdpbusd, 64 products per instruction.
Top-1 agreement with float32 on real text (`nexttoken bench --accuracy --quantize int4`, integer activations):
93.97% on the packaged model and 85.66% on stories260k, against 94.20% / 85.78% with int16.

Layout (what the kernel reads): K padded with zero weights to Kp, a multiple of 128; `weight` (N, Kp/2) uint8,
whose bytes [64c, 64c + 64) of a row hold its 128-column chunk c; byte b keeps column COLUMN_OF[b] of the chunk
in its low nibble and COLUMN_OF[64 + b] in its high nibble, each stored as q + 8; `scale` (N, Kp/32) float16. The
order lets the kernel split a 64-byte load into two vectors of 64 byte-wide weights with a shift and masks alone,
every four consecutive bytes (one int32 lane of their VNNI sums) in one group (csrc/int4.cpp's column_of).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from ..arithmetic import Arithmetic
from ..native_abi import Kind, NtLinear, weight_rows
from . import tiles

GROUP = 32  # columns per scale
CHUNK = 128  # columns per 64 packed bytes (four groups); K is padded to a multiple of this
# Chunk column of nibble position p (p < 64: low nibble of byte p, else high nibble of byte p - 64), as
# csrc/int4.cpp's column_of(b, h): word b // 2 -> weight vector j = 2 * (b % 2) + h, int32 lane i = b // 4 of
# group i % 4, column 8 * (i // 4) + 2 * j + (b // 2) % 2 of that group.
COLUMN_OF = torch.tensor([32 * ((b // 4) % 4) + 8 * (b // 16) + 2 * (2 * (b % 2) + h) + (b // 2) % 2
                          for h in (0, 1) for b in range(64)])
POSITION_OF = torch.argsort(COLUMN_OF)  # chunk column -> nibble position
MAX_DECODE_K = 32768  # the decode kernel's activation buffer (csrc/int4.cpp); longer rows take the prefill path


def padded(K: int) -> int:
    return -(-K // CHUNK) * CHUNK


# Candidate scales d = f * m / -8: f = 1 is Q4_0's; smaller ones clip the extreme value a little for a finer
# step on the rest. Each group keeps the candidate with the least squared error (measured on the packaged model
# and stories260k: top-1 agreement with float32 94.6% / 86.5% with the search, 92.2% / 85.5% without).
SCALE_FACTORS = (1.0, 0.98, 0.96, 0.94, 0.92, 0.90)


def quantize_groups(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) float -> (packed (N, Kp/2) uint8, scales (N, Kp/32) float16), the layout above. Natively where
    the kernels run (the same arithmetic: a 1B model in seconds instead of minutes), else in torch."""
    if w.device.type == "cpu" and kernels.int4_available():
        return kernels.quantize_int4(w, SCALE_FACTORS, padded(w.shape[1]))
    return quantize_groups_reference(w)


def quantize_groups_reference(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_groups in torch: the definition the native quantizer is tested against."""
    N, K = w.shape
    Kp = padded(K)
    packed = torch.empty(N, Kp // 2, dtype=torch.uint8)
    scales = torch.empty(N, Kp // GROUP, dtype=torch.float16)
    step = max(1, (1 << 22) // Kp)  # rows per pass: a few 16 MB temporaries, whatever the matrix
    for n0 in range(0, N, step):
        packed[n0 : n0 + step], scales[n0 : n0 + step] = _quantize_rows(w[n0 : n0 + step], Kp)
    return packed, scales


def _quantize_rows(w: torch.Tensor, Kp: int) -> tuple[torch.Tensor, torch.Tensor]:
    N, K = w.shape
    groups = torch.zeros(N, Kp, dtype=torch.float32, device=w.device)
    groups[:, :K] = w.float()
    groups = groups.view(N, Kp // GROUP, GROUP)  # (N, G, 32)
    extreme = groups.gather(-1, groups.abs().argmax(-1, keepdim=True))  # (N, G, 1): signed, largest magnitude
    best_q = best_scale = best_err = None
    for f in SCALE_FACTORS:
        scale = (extreme * (f / -8)).clamp(-65504, 65504).to(torch.float16)  # (N, G, 1)
        d = scale.float()
        # Divided by the stored (float16) scale, so values round against the scale the kernel multiplies by.
        q = torch.where(d != 0, torch.round(groups / torch.where(d != 0, d, 1.0)), 0.0).clamp_(-8, 7)  # (N, G, 32)
        err = ((q * d).double() - groups.double()).square_().sum(-1, keepdim=True)  # (N, G, 1) in float64
        if best_err is None:
            best_q, best_scale, best_err = q, scale, err
        else:
            better = err < best_err
            best_q, best_scale = torch.where(better, q, best_q), torch.where(better, scale, best_scale)
            best_err = torch.minimum(err, best_err)
    u = (best_q + 8).to(torch.uint8).view(N, Kp // CHUNK, CHUNK)[..., COLUMN_OF]  # (N, chunks, 128 nibble positions)
    packed = u[..., :64] | (u[..., 64:] << 4)  # (N, chunks, 64 bytes)
    return packed.reshape(N, Kp // 2), best_scale.reshape(N, Kp // GROUP)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) float -> (q (M, Kp) int8, scale (M, Kp/32) float32), what the decode kernel multiplies: per group of
    32 columns (padded with zeros to Kp), scale = the largest magnitude / 127 and q = x / scale rounded half to
    even (0 in an all-zero group)."""
    M, K = x.shape
    Kp = padded(K)
    groups = torch.zeros(M, Kp, dtype=torch.float32)
    groups[:, :K] = x.float()
    groups = groups.view(M, Kp // GROUP, GROUP)
    scale = groups.abs().amax(-1) / 127  # (M, G) float32, as the kernel divides
    safe = torch.where(scale > 0, scale, 1.0)[..., None]
    q = torch.where(scale[..., None] > 0, torch.round(groups / safe), 0.0).to(torch.int8)
    return q.view(M, Kp), scale


def linear_reference(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, K: int) -> torch.Tensor:
    """(M, N) float64: what the decode kernel computes up to float32 rounding, the sum over groups of weight scale
    x activation scale x (q . xq) (quantize_activations' int8 activations)."""
    q, xs = quantize_activations(x)  # (M, Kp), (M, G)
    N = packed.shape[0]
    w = dequantize_groups(packed, torch.ones_like(scales), packed.shape[1] * 2).double()  # (N, Kp) the q values
    G = xs.shape[1]
    per_group = torch.einsum("mgk,ngk->mng", q.double().view(-1, G, GROUP), w.view(N, G, GROUP))  # (M, N, G)
    return (per_group * xs.double()[:, None, :] * scales.double()[None]).sum(-1)


def dequantize_groups(packed: torch.Tensor, scales: torch.Tensor, K: int) -> torch.Tensor:
    """The float32 (N, K) weights that (packed, scales) stand for: q * scale of each group."""
    N = packed.shape[0]
    chunks = packed.view(N, -1, CHUNK // 2)  # (N, chunks, 64 bytes)
    u = torch.cat((chunks & 15, chunks >> 4), dim=-1)[..., POSITION_OF]  # (N, chunks, 128 columns)
    q = u.reshape(N, -1, GROUP).float() - 8  # (N, G, 32)
    return (q * scales.float()[..., None]).reshape(N, -1)[:, :K]


class Int4Linear(nn.Module):
    """y = x @ W^T + bias with W stored as 4-bit groups (`weight` packed uint8, `scale` float16; see above)."""

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, in_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, packed.shape[0]
        self.register_buffer("weight", packed)  # (N, Kp/2) uint8
        self.register_buffer("scale", scale)  # (N, Kp/32) float16
        self.register_buffer("bias", bias)  # (N,) float32 or None
        self.activations = Arithmetic.quantized_activations  # the policy's default: "float32", exact

    def use_arithmetic(self, policy: Arithmetic) -> None:
        """A model's policy: quantized_activations "float32" (exact) or "integer" (int8 per group at decode)."""
        self.activations = policy.quantized_activations

    @property
    def exact(self) -> bool:
        return getattr(self, "activations", "float32") == "float32"

    @classmethod
    def from_linear(cls, linear: nn.Module) -> "Int4Linear":
        packed, scale = quantize_groups(linear.weight.detach())
        bias = None if linear.bias is None else linear.bias.detach().float()
        return cls(packed, scale, linear.weight.shape[1], bias)

    def dequantized(self) -> torch.Tensor:
        """(N, K) float32 weights this layer multiplies by."""
        return dequantize_groups(self.weight, self.scale, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, K = x.shape[:-1], self.in_features
        x2 = x.reshape(-1, K)  # (M, K)
        native = (x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
                  and not torch.is_grad_enabled() and kernels.int4_available())
        if native and x2.shape[0] <= kernels.MAX_ROWS and padded(K) <= MAX_DECODE_K:  # decode: weights streamed once
            return kernels.linear_int4(x, self.weight, self.scale, K, self.bias, exact=self.exact)
        if native:
            y = self._prefill_in_blocks(x2)
        else:
            y = F.linear(x2, self.dequantized().to(x.device, x.dtype))
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.view(*lead, self.out_features)

    def _prefill_in_blocks(self, x: torch.Tensor) -> torch.Tensor:
        """x (M, K) @ dequantized weights^T, a block of output rows at a time (quant/tiles.py)."""
        return tiles.matmul(x, self.out_features, lambda n0, n1, dtype, out: kernels.dequantize_int4(
            self.weight[n0:n1], self.scale[n0:n1], self.in_features, dtype, out=out))

    def native(self) -> NtLinear | None:
        """The kernels' description (native_abi.describe): W_I4, int4.cpp's layout, where its kernels run here."""
        kind = Kind.W_I4_F32 if self.exact else Kind.W_I4
        return weight_rows(self.weight, self.bias, self.scale, kind) if kernels.int4_available() else None
