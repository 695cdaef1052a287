"""The gated delta rule (Gated DeltaNet: Qwen3.5's and Qwen3-Next's linear-attention layers), transformers'
Qwen3_5GatedDeltaNet with its torch fallbacks torch_chunk_gated_delta_rule (prefill: chunks of 64 solved in
parallel) and torch_recurrent_gated_delta_rule (decode: one step), in their order of operations.

Per value head the state is a (Dk, Dv) matrix S: each token decays it by exp(g), reads k's prediction k^T S, writes
beta (v - k^T S) along k, and outputs q^T S. Before it, a causal convolution of K taps over [q; k; v] (state: its
window); after it, an RMSNorm gated by silu(z) and out_proj.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...config import ModelConfig
from ..batch import ForwardBatch
from ..linear import Linear
from ..state import SequenceState
from .conv import causal_conv, gated_rms_norm, masked

CHUNK = 64  # transformers' chunk_size


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor):  # noqa: ANN202
    """(B, T, H*, D) inputs -> float32 (B, H, T, ...) with k heads repeated to the value heads, q and k L2-normed,
    q scaled by 1/sqrt(Dk)."""
    hk, hv = k.shape[2], v.shape[2]
    if hk != hv:
        q, k = q.repeat_interleave(hv // hk, dim=2), k.repeat_interleave(hv // hk, dim=2)
    q, k, v, beta, g = [x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
                        for x in (q, k, v, beta, g)]
    q, k = l2norm(q), l2norm(k)
    return q, k, v, g, beta


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k (B, T, Hk, Dk), v (B, T, Hv, Dv), g and beta (B, T, Hv), state (B, Hv, Dk, Dv) float32 ->
    (out (B, T, Hv, Dv) in q's dtype, the state after the T tokens)."""
    dtype, T = q.dtype, q.shape[1]
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    q = q * q.shape[-1] ** -0.5
    pad = (CHUNK - T % CHUNK) % CHUNK
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    v_beta, k_beta = v * beta.unsqueeze(-1), k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = [x.reshape(x.shape[0], x.shape[1], -1, CHUNK, x.shape[-1]) for x in (q, k, k_beta, v_beta)]
    g = g.reshape(g.shape[0], g.shape[1], -1, CHUNK)  # (B, H, chunks, CHUNK)
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    cum = g.cumsum(dim=3)
    pairwise = (cum.unsqueeze(4) - cum.unsqueeze(3)).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * pairwise
    intra = (q @ k.transpose(-1, -2)) * pairwise
    decayed_k_beta = k_beta * cum.exp().unsqueeze(-1)
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(system, decayed_k_beta, upper=False, unitriangular=True)
    s = state.to(new_values)
    out = torch.zeros_like(new_values)
    q = q * cum.exp().unsqueeze(-1)
    k = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    for i in range(q.shape[2]):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ s
        out[:, :, i] = q[:, :, i] @ s + intra[:, :, i] @ v_new
        s = s * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(out.shape[0], out.shape[1], -1, out.shape[-1])[:, :, :T]
    return out.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format), s


def recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """chunked's result one token at a time (decode)."""
    dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    q = q / (q.shape[-1] ** 0.5)
    s = state.to(v)
    out = torch.zeros_like(v)
    for i in range(q.shape[2]):
        s = s * g[:, :, i].exp()[..., None, None]
        memory = (s * k[:, :, i].unsqueeze(-1)).sum(dim=-2)
        delta = (v[:, :, i] - memory) * beta[:, :, i].unsqueeze(-1)
        s = s + k[:, :, i].unsqueeze(-1) * delta.unsqueeze(-2)
        out[:, :, i] = (s * q[:, :, i].unsqueeze(-1)).sum(dim=-2)
    return out.transpose(1, 2).contiguous().to(dtype), s


def grouped_rows(hk: int, hv: int, dk: int, dv: int) -> torch.Tensor:
    """The row order that takes Qwen3-Next's [in_proj_qkvz; in_proj_ba] (per key head h: q_h, k_h, the r = hv / hk
    value heads' v then z; then per key head: r b's, r a's) to Qwen3.5's [q; k; v; z; b; a]: an index of rows
    (transformers' Qwen3NextGatedDeltaNet.fix_query_key_value_ordering, as a permutation)."""
    r = hv // hk
    per, ba = 2 * dk + 2 * r * dv, hk * (2 * dk + 2 * r * dv)
    heads = torch.arange(hk)[:, None]

    def part(base: torch.Tensor, start: int, width: int) -> torch.Tensor:
        return (base + start + torch.arange(width)).reshape(-1)

    return torch.cat([part(heads * per, 0, dk), part(heads * per, dk, dk), part(heads * per, 2 * dk, r * dv),
                      part(heads * per, 2 * dk + r * dv, r * dv), part(ba + heads * 2 * r, 0, r),
                      part(ba + heads * 2 * r, r, r)])


class GatedDeltaNet(nn.Module):
    """Qwen3.5's linear-attention layer. Its four input projections (in_proj_qkv, _z, _b, _a) are one matrix
    (Qwen3-Next's two, in_proj_qkvz and _ba, the same matrix with its rows grouped per key head)."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        rec = cfg.recurrent
        assert rec is not None
        self.layer, self.kind, self.eps = layer, cfg.layer(layer), cfg.rms_norm_eps
        self.hk, self.hv = rec.linear_num_key_heads, rec.linear_num_value_heads
        self.dk, self.dv = rec.linear_key_head_dim, rec.linear_value_head_dim
        key, value = self.hk * self.dk, self.hv * self.dv
        self.split = (key, key, value, value, self.hv, self.hv)  # q, k, v (convolved), z, b, a
        self.wi = Linear(cfg.hidden_size, sum(self.split), bias=False)
        self.conv = nn.Parameter(torch.empty(2 * key + value, 1, rec.conv_kernel))
        self.dt_bias = nn.Parameter(torch.empty(self.hv))
        self.A_log = nn.Parameter(torch.empty(self.hv))
        self.norm = nn.Parameter(torch.empty(self.dv))
        self.wo = Linear(value, cfg.hidden_size, bias=False)
        self.grouped = rec.linear_grouped_by_key_head

    @staticmethod
    def state_shapes(cfg: ModelConfig) -> list:
        rec = cfg.recurrent
        assert rec is not None
        channels = 2 * rec.linear_num_key_heads * rec.linear_key_head_dim + \
            rec.linear_num_value_heads * rec.linear_value_head_dim
        return [((channels, rec.conv_kernel - 1), None),  # the convolution's window over [q; k; v]
                ((rec.linear_num_value_heads, rec.linear_key_head_dim, rec.linear_value_head_dim), torch.float32)]

    @staticmethod
    def checkpoint(cfg: ModelConfig, layer: int) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
        rec = cfg.recurrent
        assert rec is not None
        C, p = cfg.hidden_size, f"model.layers.{layer}.linear_attn."
        key, value = rec.linear_num_key_heads * rec.linear_key_head_dim, rec.linear_num_value_heads * rec.linear_value_head_dim
        hv = rec.linear_num_value_heads
        wi = [(p + "in_proj_qkv.weight", (2 * key + value, C)), (p + "in_proj_z.weight", (value, C)),
              (p + "in_proj_b.weight", (hv, C)), (p + "in_proj_a.weight", (hv, C))]
        if rec.linear_grouped_by_key_head:  # Qwen3-Next: the same rows, grouped per key head (grouped_rows)
            wi = [(p + "in_proj_qkvz.weight", (2 * key + 2 * value, C)), (p + "in_proj_ba.weight", (2 * hv, C))]
        return {"wi.weight": wi,
                "conv": [(p + "conv1d.weight", (2 * key + value, 1, rec.conv_kernel))],
                "dt_bias": [(p + "dt_bias", (hv,))], "A_log": [(p + "A_log", (hv,))],
                "norm": [(p + "norm.weight", (rec.linear_value_head_dim,))],
                "wo.weight": [(p + "out_proj.weight", (C, value))]}

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # type: ignore[no-untyped-def]
        # Qwen3-Next's checkpoint rows grouped per key head: put into our [q; k; v; z; b; a] order once, at load
        name = prefix + "wi.weight"
        if self.grouped and name in state_dict:
            state_dict[name] = state_dict[name][grouped_rows(self.hk, self.hv, self.dk, self.dv)]
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, state: SequenceState, cos: torch.Tensor | None,
                sin: torch.Tensor | None) -> torch.Tensor:
        B, T, _ = x.shape
        qkv, z, b, a = self.wi(masked(x, batch)).split((sum(self.split[:3]), *self.split[3:]), dim=-1)
        window, s = state.slots(self.layer, batch)
        qkv, window = causal_conv(qkv.transpose(1, 2), window, self.conv, None, silu=True)
        qkv = qkv.transpose(1, 2)  # (B, T, 2 Hk Dk + Hv Dv)
        q, k, v = qkv.split(self.split[:3], dim=-1)
        q, k = q.reshape(B, T, self.hk, self.dk), k.reshape(B, T, self.hk, self.dk)
        v = v.reshape(B, T, self.hv, self.dv)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # (B, T, Hv) log decay
        out, s = (recurrent if T == 1 else chunked)(q, k, v, g, beta, s)
        state.keep(self.layer, batch, [window, s])
        out = gated_rms_norm(out.reshape(-1, self.dv), z.reshape(-1, self.dv), self.norm, self.eps)
        return self.wo(out.reshape(B, T, -1))
