"""Mamba2's selective state space layer (SSD) as Granite 4.0-H runs it: transformers' GraniteMoeHybridMambaLayer with
its torch fallbacks mamba2_chunk_scan (prefill: chunks of `mamba_chunk_size` in parallel) and
mamba2_selective_state_update (decode: one step), in their order of operations.

in_proj gives the gate z, [x; B; C] (convolved over `mamba_d_conv` taps, then silu) and dt per head. Per head h the
state is a (head_dim P, state_size N) matrix: each token decays it by exp(dt A_h) and adds dt x B^T; the output is
S C + D x. Then an RMSNorm over each of `n_groups` parts of x * silu(z), and out_proj.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...config import ModelConfig
from ..batch import ForwardBatch
from ..linear import Linear
from ..state import SequenceState
from .conv import causal_conv, masked


def _pad(x: torch.Tensor, pad: int) -> torch.Tensor:
    """x (B, T, ...) with `pad` zero positions appended along T."""
    return F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))


def _chunks(x: torch.Tensor, pad: int, size: int) -> torch.Tensor:
    """(B, T, ...) -> (B, chunks, size, ...), zero-padded."""
    x = _pad(x, pad)
    return x.reshape(x.shape[0], -1, size, *x.shape[2:])


def segment_sum(x: torch.Tensor) -> torch.Tensor:
    """x (..., L) -> (..., L, L): sum of x over (j, i] below the diagonal, 0 on it, -inf above (transformers')."""
    L = x.size(-1)
    x = x[..., None].expand(*x.size(), L)
    x = x.masked_fill(~torch.tril(torch.ones(L, L, dtype=torch.bool, device=x.device), diagonal=-1), 0)
    s = torch.cumsum(x, dim=-2)
    return s.masked_fill(~torch.tril(torch.ones(L, L, dtype=torch.bool, device=x.device), diagonal=0), -torch.inf)


def chunk_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
               D: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, size: int,
               limit: tuple[float, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """x (B, T, H, P), dt (B, T, H), A (H,), B and C (B, T, G, N), state (B, H, P, N) -> (y (B, T, H, P) float32,
    the state after the T tokens)."""
    T, H = x.shape[1], x.shape[2]
    dt = torch.clamp(F.softplus(dt + dt_bias.to(dt.dtype)), min=limit[0], max=limit[1])
    x = x.float()
    B = B.float().repeat_interleave(H // B.shape[2], dim=2, output_size=H)
    C = C.float().repeat_interleave(H // C.shape[2], dim=2, output_size=H)
    pad = (size - T % size) % size
    residual = D[..., None] * _pad(x, pad)
    x = x * dt[..., None].float()
    A = A.to(x.dtype) * dt.float()
    x, A, B, C = [_chunks(t, pad, size) for t in (x, A, B, C)]
    A = A.permute(0, 3, 1, 2)  # (B, H, chunks, size)
    A_cumsum = torch.cumsum(A, dim=-1)
    L = torch.exp(segment_sum(A))
    G = torch.einsum("bclhn,bcshn->bclsh", C, B)
    M = G * L.permute(0, 2, 3, 4, 1)
    y_diag = torch.einsum("bclsh,bcshp->bclhp", M, x)
    decay_states = torch.exp(A_cumsum[:, :, :, -1:] - A_cumsum)
    B_decay = B * decay_states.permute(0, -2, -1, 1)[..., None]
    states = torch.einsum("bclhn,bclhp->bchpn", B_decay, x)
    states = torch.cat([state[:, None].to(states.dtype), states], dim=1)
    decay_chunk = torch.exp(segment_sum(F.pad(A_cumsum[:, :, :, -1], (1, 0)))).transpose(1, 3)
    new_states = torch.einsum("bzch,bzhpn->bchpn", decay_chunk, states)
    states, final = new_states[:, :-1], new_states[:, -1]
    y_off = torch.einsum("bclhn,bchpn->bclhp", C, states) * torch.exp(A_cumsum).permute(0, 2, 3, 1)[..., None]
    y = (y_diag + y_off).reshape(x.shape[0], -1, H, x.shape[-1]) + residual
    return y[:, :T], final


def state_update(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                 D: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token: x (B, H, P), dt (B, H), B and C (B, G, N), state (B, H, P, N) -> (y (B, H, P) in x's dtype, the
    new state). transformers' mamba2_selective_state_update (no dt clamp there)."""
    b, H, P = x.shape
    N, G = B.shape[-1], B.shape[1]
    dt = F.softplus(dt[..., None].expand(-1, -1, P) + dt_bias[:, None].to(dt.dtype))[..., None]  # (B, H, P, 1)
    dA = torch.exp(dt.float() * A[:, None, None].float())  # (B, H, P, 1) over N by broadcast
    B = B.reshape(b, G, 1, N).expand(b, G, H // G, N).reshape(b, H, 1, N)
    new = state * dA + (dt * B) * x[..., None]
    C = C.reshape(b, G, 1, N).expand(b, G, H // G, N).reshape(b, H, N)
    y = torch.bmm(new.to(C.dtype).view(b * H, P, N), C.reshape(b * H, N, 1)).view(b, H, P)
    y = (y + x * D[:, None]).to(y.dtype)
    return y.to(x.dtype), new.to(state.dtype)


class Mamba2Mixer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        rec = cfg.recurrent
        assert rec is not None
        self.layer, self.kind, self.eps = layer, cfg.layer(layer), cfg.rms_norm_eps
        self.heads, self.head_dim, self.n = rec.mamba_num_heads, rec.mamba_head_dim, rec.mamba_state_size
        self.groups, self.chunk, self.limit = rec.mamba_n_groups, rec.mamba_chunk_size, rec.time_step_limit
        self.norm_groups = rec.mamba_norm_groups
        inner = self.heads * self.head_dim
        self.split = (inner, inner + 2 * self.groups * self.n, self.heads)  # z, [x; B; C], dt
        self.wi = Linear(cfg.hidden_size, sum(self.split), bias=rec.mamba_proj_bias)
        self.conv = nn.Parameter(torch.empty(self.split[1], 1, rec.conv_kernel))
        self.conv_bias = nn.Parameter(torch.empty(self.split[1])) if rec.conv_bias else None
        self.dt_bias = nn.Parameter(torch.empty(self.heads))
        self.A_log = nn.Parameter(torch.empty(self.heads))
        self.D = nn.Parameter(torch.empty(self.heads))
        self.norm = nn.Parameter(torch.empty(inner))
        self.wo = Linear(inner, cfg.hidden_size, bias=rec.mamba_proj_bias)

    @staticmethod
    def state_shapes(cfg: ModelConfig) -> list:
        rec = cfg.recurrent
        assert rec is not None
        channels = rec.mamba_num_heads * rec.mamba_head_dim + 2 * rec.mamba_n_groups * rec.mamba_state_size
        return [((channels, rec.conv_kernel - 1), None),  # the convolution's window over [x; B; C]
                ((rec.mamba_num_heads, rec.mamba_head_dim, rec.mamba_state_size), torch.float32)]

    @staticmethod
    def checkpoint(cfg: ModelConfig, layer: int) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
        rec = cfg.recurrent
        assert rec is not None
        C, p, H = cfg.hidden_size, f"model.layers.{layer}.mamba.", rec.mamba_num_heads
        inner = H * rec.mamba_head_dim
        channels = inner + 2 * rec.mamba_n_groups * rec.mamba_state_size
        out = {"wi.weight": [(p + "in_proj.weight", (inner + channels + H, C))],
               "conv": [(p + "conv1d.weight", (channels, 1, rec.conv_kernel))],
               "dt_bias": [(p + "dt_bias", (H,))], "A_log": [(p + "A_log", (H,))], "D": [(p + "D", (H,))],
               "norm": [(p + "norm.weight", (inner,))], "wo.weight": [(p + "out_proj.weight", (C, inner))]}
        if rec.conv_bias:
            out["conv_bias"] = [(p + "conv1d.bias", (channels,))]
        if rec.mamba_proj_bias:
            out |= {"wi.bias": [(p + "in_proj.bias", (inner + channels + H,))], "wo.bias": [(p + "out_proj.bias", (C,))]}
        return out

    def forward(self, x: torch.Tensor, batch: ForwardBatch, state: SequenceState, cos: torch.Tensor | None,
                sin: torch.Tensor | None) -> torch.Tensor:
        b, T, _ = x.shape
        dtype = x.dtype
        z, xbc, dt = self.wi(masked(x, batch)).split(self.split, dim=-1)
        window, s = state.slots(self.layer, batch)
        xbc, window = causal_conv(xbc.transpose(1, 2), window, self.conv, self.conv_bias, silu=True)
        xbc = masked(xbc.transpose(1, 2), batch)  # transformers masks the padding again after the convolution
        h, B, C = xbc.split((self.split[0], self.groups * self.n, self.groups * self.n), dim=-1)
        A = -torch.exp(self.A_log.float())
        if T == 1:
            y, s = state_update(h.view(b, self.heads, self.head_dim), dt[:, 0], A, B.view(b, self.groups, self.n),
                                C.view(b, self.groups, self.n), self.D, self.dt_bias, s)
        else:
            y, s = chunk_scan(h.view(b, T, self.heads, self.head_dim), dt, A, B.view(b, T, self.groups, self.n),
                              C.view(b, T, self.groups, self.n), self.D, self.dt_bias, s, self.chunk, self.limit)
        state.keep(self.layer, batch, [window, s])
        return self.wo(self._norm(y.reshape(b, T, -1), z).to(dtype))

    def _norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """transformers' GraniteMoeHybridRMSNormGated: the gate first, then RMSNorm over each of the groups."""
        dtype = y.dtype
        h = y.float() * F.silu(z.float())
        g = h.view(*h.shape[:-1], self.norm_groups, -1)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.norm * g.view(h.shape).to(dtype)
