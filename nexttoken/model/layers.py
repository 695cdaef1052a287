"""The parts of a decoder block (docs/models.md): RMSNorm, attention with its RoPE and K/V cache writes, the gated
MLP (or MoE) and the block that joins them; llama.py assembles them into the Transformer.

A block's mixer is the module of its declared layer kind (families/base.py's LayerKind.mixer -> MIXERS below), with
one contract: forward(x (B, T, C), batch, state, cos, sin) -> (B, T, C), reading and writing only its own layer's
part of the per-sequence state (state.py's SequenceState). Attention here; issue 41's recurrent kinds (short
convolution, gated delta rule, state space) are model/recurrent/'s.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .batch import ForwardBatch
from .linear import Linear
from .moe import MoE
from .recurrent import MIXERS as RECURRENT_MIXERS
from .rope import apply_rope
from .state import SequenceState


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, plus_one: bool = False) -> None:
        super().__init__()
        self.eps, self.plus_one = eps, plus_one
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32, scale in the input dtype: transformers' order, which bf16 parity depends on.
        # In-place where the temporaries are our own: fewer allocations per decode step, the same arithmetic.
        dtype = x.dtype
        if dtype != torch.float32:
            x = x.float()
        x = x * x.pow(2).mean(-1, keepdim=True).add_(self.eps).rsqrt_()
        if self.plus_one:  # Gemma: scaled by (1 + weight) in float32, then cast (its order, not Llama's)
            return (x * (1.0 + self.weight.float())).to(dtype)
        return self.weight * (x if dtype == torch.float32 else x.to(dtype))


def activation(name: str):  # noqa: ANN201
    """The MLP's gate activation by its config name (ModelConfig validated it)."""
    if name == "gelu_pytorch_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    return F.silu


class Attention(nn.Module):
    """The attention kinds (full, sliding, NoPE): reads its rows' K/V columns through `state.update`, after writing
    the new tokens' own; rotates q and k with the RoPE its kind names (cos / sin None: a NoPE layer)."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.split = (q_size, kv_size, kv_size)
        # Qwen3.5: q_proj's rows are [query; gate] per head, the output scaled by sigmoid(gate) before o_proj
        self.gated = cfg.attention_output_gate
        self.rotary = cfg.rotary_dim or self.head_dim  # the rotated first part of each head (the rest passes)
        rows = q_size * (2 if self.gated else 1) + 2 * kv_size
        self.wqkv = Linear(cfg.hidden_size, rows, bias=cfg.qkv_bias or cfg.attention_bias)
        self.wo = Linear(q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.kind = cfg.layer(layer)  # families/base.py's LayerKind: its window and its RoPE (None: NoPE)
        self.sliding = self.kind.window
        # q and k RMS-normalised before RoPE: each head over its head_dim (Qwen3), or the whole projection (OLMo 2).
        self.qk_norm = cfg.qk_norm
        q_dim, k_dim = (self.head_dim, self.head_dim) if cfg.qk_norm == "head" else (q_size, kv_size)
        self.q_norm = RMSNorm(q_dim, cfg.rms_norm_eps, cfg.norm_plus_one) if cfg.qk_norm else None
        self.k_norm = RMSNorm(k_dim, cfg.rms_norm_eps, cfg.norm_plus_one) if cfg.qk_norm else None
        self.scale = cfg.attention_multiplier  # None: SDPA's 1/sqrt(head_dim)
        self.softcap = cfg.attn_logit_softcapping
        # gpt-oss: one learned logit per head that joins every softmax (H,); None: no sinks
        self.sinks = nn.Parameter(torch.zeros(self.n_heads)) if cfg.attention_sinks else None

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, state: SequenceState, cos: torch.Tensor | None, sin: torch.Tensor | None
    ) -> torch.Tensor:
        B, T, _ = x.shape
        gate = None
        if self.gated:
            qg, kv = self.wqkv(x).split((2 * self.split[0], 2 * self.split[1]), dim=-1)
            q, gate = qg.view(B, T, self.n_heads, 2 * self.head_dim).chunk(2, dim=-1)  # (B, T, H, D) each
            k, v = kv.split(self.split[1:], dim=-1)
            qk, gate = torch.cat([q.reshape(B, T, -1), k], dim=-1), gate.reshape(B, T, -1)
        else:
            qk, v = self.wqkv(x).split((self.split[0] + self.split[1], self.split[2]), dim=-1)
        if self.qk_norm == "projection":
            q, k = qk.split(self.split[:2], dim=-1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=-1)
        # q and k heads rotated together: one set of RoPE ops per layer instead of two (fewer ops per decode step).
        qk = qk.view(B, T, self.n_heads + self.n_kv_heads, self.head_dim)  # (B, T, H + Hkv, D)
        if self.qk_norm == "head":
            q, k = qk.split((self.n_heads, self.n_kv_heads), dim=2)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=2)
        qk = qk.transpose(1, 2)  # (B, H + Hkv, T, D)
        if cos is not None and self.rotary < self.head_dim:  # partial RoPE (Qwen3.5): the first `rotary` dims
            qk = torch.cat([apply_rope(qk[..., : self.rotary], cos, sin), qk[..., self.rotary :]], dim=-1)
        elif cos is not None:  # a NoPE layer (SmolLM3) is handed no tables
            qk = apply_rope(qk, cos, sin)
        q, k = qk.split((self.n_heads, self.n_kv_heads), dim=1)  # (B, H|Hkv, T, D)
        v = v.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        keys, values = state.update(self.layer, batch, k, v)  # (B, Hkv, S, D)
        mask = batch.window_mask if self.sliding else batch.mask
        if batch.rowwise and B > 1:  # each row alone: its numbers cannot depend on its batch-mates
            y = torch.cat([self._attend(q[b : b + 1], keys[b : b + 1], values[b : b + 1],
                                        None if mask is None else mask[b : b + 1]) for b in range(B)])
        else:
            y = self._attend(q, keys, values, mask)  # (B, H, T, D)
        y = y.transpose(1, 2).reshape(B, T, -1)
        if gate is not None:
            y = y * torch.sigmoid(gate)
        return self.wo(y)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        """q (B, H, T, D), keys and values (B, Hkv, S, D), mask (B, 1, T, S) bool or None -> (B, H, T, D)."""
        if self.sinks is not None:
            return sink_attention(q, keys, values, mask, self.scale, self.sinks)
        if self.softcap is not None:
            return softcapped_attention(q, keys, values, mask, self.scale, self.softcap)
        return F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, enable_gqa=self.n_heads != self.n_kv_heads, scale=self.scale
        )


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                         scale: float | None, cap: float) -> torch.Tensor:
    """Attention whose scores are soft-capped (Gemma 2: cap * tanh(s / cap)) before the softmax, which SDPA cannot
    do: q (B, H, T, D), k and v (B, Hkv, S, D), mask (B, 1, T, S) bool or None -> (B, H, T, D). transformers'
    eager order: scores in the activation dtype, softmax in float32, probabilities cast back."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # (B, H, S, D)
    scores = (q @ k.transpose(2, 3)) * (q.shape[-1] ** -0.5 if scale is None else scale)  # (B, H, T, S)
    scores = torch.tanh(scores / cap) * cap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   scale: float | None, sinks: torch.Tensor) -> torch.Tensor:
    """Attention with a learned logit per head in each softmax (gpt-oss's sinks: (H,)), which takes its share of
    the probability and is then dropped: q (B, H, T, D), k and v (B, Hkv, S, D), mask (B, 1, T, S) bool or None ->
    (B, H, T, D). transformers' eager order: scores in the activation dtype, the row max subtracted, softmax."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # (B, H, S, D)
    scores = (q @ k.transpose(2, 3)) * (q.shape[-1] ** -0.5 if scale is None else scale)  # (B, H, T, S)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    B, H, T, _ = scores.shape
    logits = torch.cat([scores, sinks.to(scores.dtype).reshape(1, H, 1, 1).expand(B, H, T, 1)], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]  # the sink's share dropped
    return probs.to(v.dtype) @ v


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate: int | None = None) -> None:
        super().__init__()
        self.intermediate = intermediate or cfg.intermediate_size  # a MoE expert's is its own
        self.w13 = Linear(cfg.hidden_size, 2 * self.intermediate, bias=cfg.mlp_bias)  # gate ++ up
        self.w2 = Linear(self.intermediate, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = activation(cfg.hidden_act)
        self.limit, self.alpha = cfg.swiglu_limit, cfg.swiglu_alpha  # gpt-oss's clamped SwiGLU; None: the plain gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).split(self.intermediate, dim=-1)
        if self.limit is not None:
            return self.w2(clamped_swiglu(gate, up, self.limit, self.alpha))
        return self.w2(self.act(gate) * up)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """gpt-oss's expert gate, in transformers' order: gate clamped above, up both sides, (up + 1) * glu.
    gate and up (..., I). The sigmoid reads its input through rows of stride I + 1, so torch runs it one row at a
    time: over one flat tensor its vector and remainder paths round differently, and a row's numbers would then
    depend on how many rows share the call (the engine's batch invariance)."""
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    rows = gate.new_empty(*gate.shape[:-1], gate.shape[-1] + 1)[..., :-1]  # (..., I) with a row stride of I + 1
    torch.mul(gate, alpha, out=rows)
    return (up + 1) * (gate * torch.sigmoid(rows))


# LayerKind.mixer -> the module that computes it (ModelConfig only declares kinds a family reader produced).
MIXERS = {"attention": Attention, **RECURRENT_MIXERS}


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_plus_one)
        self.attention = MIXERS[cfg.layer(layer).mixer](cfg, layer)  # the declared kind's module
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_plus_one)
        self.mlp = MoE(cfg, lambda width: MLP(cfg, width)) if cfg.moe and cfg.moe.sparse_layers[layer] else (
            MLP(cfg) if cfg.intermediate_size else None)  # None: Mamba2, the mixer alone
        if self.mlp is None:
            self.ffn_norm = None
        self.norm_after, self.residual = cfg.norm_after, cfg.residual_multiplier
        if cfg.sandwich_norm:  # Gemma 2 / 3: each branch's output normed too, before the residual add
            self.attention_post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_plus_one)
            self.ffn_post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_plus_one)
        self.sandwich = cfg.sandwich_norm

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, state: SequenceState, cos: torch.Tensor | None, sin: torch.Tensor | None
    ) -> torch.Tensor:
        if self.mlp is None:  # Mamba2's block: norm, mixer, residual
            return x + self.attention(self.attention_norm(x), batch, state, cos, sin)
        if self.sandwich:
            x = x + self.attention_post_norm(self.attention(self.attention_norm(x), batch, state, cos, sin))
            return x + self.ffn_post_norm(self.mlp(self.ffn_norm(x)))
        if self.norm_after:  # OLMo 2: the branch's output is normed, then added
            x = x + self.attention_norm(self.attention(x, batch, state, cos, sin))
            return x + self.ffn_norm(self.mlp(x))
        if self.residual != 1.0:  # Granite scales each branch before the residual add
            x = x + self.attention(self.attention_norm(x), batch, state, cos, sin) * self.residual
            return x + self.mlp(self.ffn_norm(x)) * self.residual
        x = x + self.attention(self.attention_norm(x), batch, state, cos, sin)
        return x + self.mlp(self.ffn_norm(x))
