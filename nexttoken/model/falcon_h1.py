"""Falcon-H1's decoder (transformers' modeling_falcon_h1.py): each layer runs attention and a Mamba2 mixer side by
side on the same normed input and adds both to the residual, then a gated MLP; µP multipliers (config.MupConfig) on
the keys, on each branch's input and output, on the five parts of the Mamba2 in_proj's output (the "mup vector") and
on the MLP's gate and down projections; logits x lm_head_multiplier (our logits_scaling is its inverse).

Its layer i is two of ours (families/falcon_h1.py declares 2N layer kinds): 2i, the Mamba2 mixer, which keeps a
state slot, and 2i + 1, the attention, which keeps K/V; so the caches, the engine's pool and its state slots serve it
as they serve any hybrid. The multipliers that scale a projection's output rows (the mup vector, the key, gate and
down multipliers) are folded into those rows at load; the branches' own multipliers are applied as transformers
applies them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .arithmetic import Arithmetic
from .batch import ForwardBatch
from .layers import MLP, Attention, RMSNorm
from .llama import Transformer
from .recurrent.conv import gated_rms_norm
from .recurrent.ssd import Mamba2Mixer
from .state import SequenceState


def mup_vector(cfg: ModelConfig) -> torch.Tensor:
    """(2 inner + 2 groups x state + heads,) float32: each part of in_proj's output [z; x; B; C; dt] times its
    multiplier (transformers' compute_mup_vector)."""
    rec, mup = cfg.recurrent, cfg.mup
    assert rec is not None and mup is not None
    inner, gs = rec.mamba_num_heads * rec.mamba_head_dim, rec.mamba_n_groups * rec.mamba_state_size
    widths = (inner, inner, gs, gs, rec.mamba_num_heads)
    return torch.cat([torch.full((w,), float(m), device="cpu") for w, m in zip(widths, mup.ssm)])


class FalconMixer(Mamba2Mixer):
    """Mamba2's mixer with Falcon-H1's output: RMSNorm over groups then the silu(z) gate (norm_before_gate), or the
    gate alone (mamba_rms_norm false: no norm weight)."""

    native_form = "ssd_norm_first"  # model/fused.py: the native SSD with its norm first (or the gate alone)

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__(cfg, layer)
        assert cfg.mup is not None
        self.normed = cfg.mup.mamba_rms_norm
        if not self.normed:
            self.norm = None  # type: ignore[assignment]

    def _norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        if not self.normed:
            return (y.float() * F.silu(z.float())).to(y.dtype)
        return gated_rms_norm(y, z, self.norm, self.eps, self.norm_groups)


class FalconBlock(nn.Module):
    native_form = "parallel"  # model/fused.py: one native layer, the attention with the mixer beside it

    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        assert cfg.mup is not None
        self.mup = cfg.mup
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mamba = FalconMixer(cfg, 2 * index)
        self.attention = Attention(cfg, 2 * index + 1)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.config = cfg
        self.key_rows = (cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # type: ignore[no-untyped-def]
        # the multipliers of projections' output rows, folded into those rows (module docstring)
        mup, (q, kv) = self.mup, self.key_rows
        with torch.device("cpu"):  # (the loaders build the model under torch.device("meta"))
            scales = {"mamba.wi.": mup_vector(self.config), "attention.wqkv.": torch.cat(
                [torch.ones(q), torch.full((kv,), mup.key), torch.ones(kv)]),
                "mlp.w13.": torch.cat([torch.full((self.mlp.intermediate,), mup.mlp[0]),
                                       torch.ones(self.mlp.intermediate)])}
        for part, scale in scales.items():
            for kind in ("weight", "bias"):
                t = state_dict.get(prefix + part + kind)
                if t is not None:
                    shape = (-1,) + (1,) * (t.dim() - 1)
                    state_dict[prefix + part + kind] = t * scale.to(device=t.device, dtype=t.dtype).view(shape)
        for kind in ("weight", "bias"):
            t = state_dict.get(prefix + "mlp.w2." + kind)
            if t is not None and mup.mlp[1] != 1.0:
                state_dict[prefix + "mlp.w2." + kind] = t * mup.mlp[1]
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, state: SequenceState, cos: torch.Tensor | None,
                sin: torch.Tensor | None) -> torch.Tensor:
        h = self.attention_norm(x)
        mup = self.mup
        m = self.mamba(h * mup.ssm_in, batch, state, None, None) * mup.ssm_out
        a = self.attention(h * mup.attention_in, batch, state, cos, sin) * mup.attention_out
        x = x + (m + a)
        return x + self.mlp(self.ffn_norm(x))


class FalconH1Transformer(Transformer):
    """The Transformer with Falcon-H1's blocks: num_hidden_layers / 2 of them, each two of our layers."""

    def __init__(self, cfg: ModelConfig, arithmetic: Arithmetic | None = None) -> None:
        super().__init__(cfg, arithmetic)
        self.layers = nn.ModuleList(FalconBlock(cfg, i) for i in range(cfg.num_hidden_layers // 2))


def checkpoint_parts(cfg: ModelConfig) -> dict[str, list[str]]:
    """Our module names -> the checkpoint tensors each is made of (concatenated along dim 0)."""
    sd = {"embed.weight": ["model.embed_tokens.weight"], "norm.weight": ["model.final_layernorm.weight"]}
    sd["lm_head.weight"] = sd["embed.weight"] if cfg.tie_word_embeddings else ["lm_head.weight"]
    for ours, names in _layers(cfg):
        sd |= {ours + k: [n for n, _ in v] for k, v in names.items()}
    return sd


def checkpoint_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size),
              "model.final_layernorm.weight": (cfg.hidden_size,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    for _, names in _layers(cfg):
        shapes |= {n: shape for parts in names.values() for n, shape in parts}
    return shapes


def ignored(cfg: ModelConfig, name: str) -> bool:
    return False


def _layers(cfg: ModelConfig) -> list[tuple[str, dict[str, list[tuple[str, tuple[int, ...]]]]]]:
    """Per layer of the checkpoint: (our prefix, our tensor -> its checkpoint tensors (name, shape))."""
    C, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * D, cfg.num_key_value_heads * D
    out = []
    for i in range(cfg.num_hidden_layers // 2):
        p = f"model.layers.{i}."
        a, f = p + "self_attn.", p + "feed_forward."
        names = {"attention_norm.weight": [(p + "input_layernorm.weight", (C,))],
                 "ffn_norm.weight": [(p + "pre_ff_layernorm.weight", (C,))],
                 "attention.wqkv.weight": [(a + "q_proj.weight", (q, C)), (a + "k_proj.weight", (kv, C)),
                                           (a + "v_proj.weight", (kv, C))],
                 "attention.wo.weight": [(a + "o_proj.weight", (C, q))],
                 "mlp.w13.weight": [(f + "gate_proj.weight", (I, C)), (f + "up_proj.weight", (I, C))],
                 "mlp.w2.weight": [(f + "down_proj.weight", (C, I))]}
        if cfg.attention_bias:
            names |= {"attention.wqkv.bias": [(a + "q_proj.bias", (q,)), (a + "k_proj.bias", (kv,)),
                                              (a + "v_proj.bias", (kv,))], "attention.wo.bias": [(a + "o_proj.bias", (C,))]}
        if cfg.mlp_bias:
            names |= {"mlp.w13.bias": [(f + "gate_proj.bias", (I,)), (f + "up_proj.bias", (I,))],
                      "mlp.w2.bias": [(f + "down_proj.bias", (C,))]}
        mamba = Mamba2Mixer.checkpoint(cfg, i)  # under model.layers.{i}.mamba.
        assert cfg.mup is not None
        if not cfg.mup.mamba_rms_norm:
            del mamba["norm"]
        names |= {"mamba." + k: v for k, v in mamba.items()}
        out.append((f"layers.{i}.", names))
    return out
