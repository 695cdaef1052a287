"""The causal depthwise convolution every recurrent kind runs first, over its rows' window of earlier inputs, and the
padding mask the kinds apply to their input (transformers' apply_mask_to_padding_states)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..batch import ForwardBatch


def causal_conv(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                silu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x (B, C, T) new inputs, window (B, C, K - 1) the inputs before them (zeros at a sequence's start), weight
    (C, 1, K) -> (y (B, C, T), the new window (B, C, K - 1)). One product whatever T: a prefill of any chunking and
    a decode step see the same K inputs per output (transformers' causal_conv1d_fn / causal_conv1d_update; `silu`:
    their activation, applied before the cast back)."""
    full = torch.cat([window.to(weight.dtype), x.to(weight.dtype)], dim=-1)  # (B, C, K - 1 + T)
    # The K taps as K multiply-adds in tap order: torch's conv1d on CPU takes ~70 ms per call for these shapes
    # (a oneDNN primitive built each time), longer than the rest of a decode step.
    T, taps = x.shape[-1], weight[:, 0]  # taps (C, K)
    y = full[..., :T] * taps[:, :1]
    for j in range(1, taps.shape[1]):
        y = y + full[..., j : j + T] * taps[:, j : j + 1]
    if bias is not None:
        y = y + bias[:, None]
    if silu:
        y = F.silu(y)
    return y.to(x.dtype), full[..., full.shape[-1] - window.shape[-1]:].to(window.dtype)


def masked(x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """x (B, T, C) with the padding tokens' rows zeroed (a left-padded batch), so they leave the state at zero."""
    if batch.token_valid is None or x.shape[1] == 1:
        return x
    return (x * batch.token_valid[:, :, None]).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                   groups: int = 1) -> torch.Tensor:
    """RMSNorm of x (..., D) over each of `groups` equal parts, scaled by weight, times silu(gate), in float32 then
    x's dtype: Qwen3.5's RMSNormGated (norm, then gate) with groups=1."""
    dtype = x.dtype
    h = x.float()
    if groups > 1:
        h = h.view(*h.shape[:-1], groups, -1)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = h.reshape(x.shape)
    return ((weight * h.to(dtype)) * F.silu(gate.float())).to(dtype)
