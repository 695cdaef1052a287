"""Nemotron-H's decoder (transformers' modeling_nemotron_h.py): each layer of the checkpoint is ONE of a Mamba2 mixer
('M'), attention without RoPE ('*') or a squared-ReLU MLP ('-': up, relu(x)^2, down), each as norm -> it -> residual
(ModelConfig.layer_pattern, the checkpoint's hybrid_override_pattern).

Ours pairs each MLP layer with the mixer layer before it (the released patterns never put an MLP first or two in a
row; families/nemotron_h.py refuses such a pattern): our layer j is the pattern's j-th mixer, its block the Llama
block's two halves (norm -> mixer -> residual, then norm -> MLP -> residual where an MLP follows), so the layer kinds,
the caches and the engine's state slots are the mixers'. Checkpoint names: backbone.layers.{i}.norm / .mixer.*.
Nemotron 3's MoE layers ('E') pair the same way, their MLP half model/moe.py's MoE over squared-ReLU experts (the
sigmoid router of the family declaration, an ungated squared-ReLU shared expert).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .arithmetic import Arithmetic
from .batch import ForwardBatch
from .layers import MIXERS, RMSNorm
from .linear import Linear
from .llama import Transformer
from .moe import MoE
from .recurrent.ssd import Mamba2Mixer
from .state import SequenceState

# A GGUF file's matrices are kept as stored (weights/gguf_packed.py): this network uses the file's values as they are
GGUF_PACKED = True


def pairs(cfg: ModelConfig) -> list[tuple[int, int | None]]:
    """Per layer of ours: (its mixer's index in the checkpoint, the index of the MLP or MoE layer after it, or
    None)."""
    pattern, out = cfg.layer_pattern, []
    for i, c in enumerate(pattern):
        if c not in "-E":
            mlp = i + 1 if i + 1 < len(pattern) and pattern[i + 1] in "-E" else None
            out.append((i, mlp))
    return out


class ReluSquaredMLP(nn.Module):
    """NemotronHMLP: down(relu(up(x))^2), `width` wide (the dense MLP's intermediate_size by default)."""

    native_form = "relu2"  # model/fused.py: the native step's ungated MLP (NtFlag NT_RELU2)

    def __init__(self, cfg: ModelConfig, width: int | None = None, bias: bool | None = None) -> None:
        super().__init__()
        width, bias = width or cfg.intermediate_size, cfg.mlp_bias if bias is None else bias
        self.w1 = Linear(cfg.hidden_size, width, bias=bias)
        self.w2 = Linear(width, cfg.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.square(F.relu(self.w1(x))))


def _moe(cfg: ModelConfig) -> MoE:
    """Nemotron 3's MoE: bias-free squared-ReLU experts and a shared expert with the MLPs' biases."""
    moe = MoE(cfg, lambda width: ReluSquaredMLP(cfg, width, bias=False))
    moe.shared = ReluSquaredMLP(cfg, cfg.moe.shared_intermediate_size)
    return moe


class NemotronBlock(nn.Module):
    native_form = "block"  # model/fused.py: the native step's block (norm, mixer, residual; norm, MLP, residual)

    def __init__(self, cfg: ModelConfig, layer: int, mlp: bool) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attention = MIXERS[cfg.layer(layer).mixer](cfg, layer)  # Mamba2 or NoPE attention
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if mlp else None
        sparse = cfg.moe is not None and cfg.moe.sparse_layers[layer]
        self.mlp = (_moe(cfg) if sparse else ReluSquaredMLP(cfg)) if mlp else None

    def forward(self, x: torch.Tensor, batch: ForwardBatch, state: SequenceState, cos: torch.Tensor | None,
                sin: torch.Tensor | None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), batch, state, cos, sin)
        if self.mlp is None:
            return x
        return x + self.mlp(self.ffn_norm(x))


class NemotronHTransformer(Transformer):
    """The Transformer with Nemotron-H's blocks (module docstring)."""

    def __init__(self, cfg: ModelConfig, arithmetic: Arithmetic | None = None) -> None:
        super().__init__(cfg, arithmetic)
        self.layers = nn.ModuleList(NemotronBlock(cfg, j, mlp is not None) for j, (_, mlp) in enumerate(pairs(cfg)))


def checkpoint_parts(cfg: ModelConfig) -> dict[str, list[str]]:
    """Our module names -> the checkpoint tensors each is made of (concatenated along dim 0)."""
    sd = {"embed.weight": ["backbone.embeddings.weight"], "norm.weight": ["backbone.norm_f.weight"]}
    sd["lm_head.weight"] = sd["embed.weight"] if cfg.tie_word_embeddings else ["lm_head.weight"]
    for ours, names in _layers(cfg):
        sd |= {ours + k: [n for n, _ in v] for k, v in names.items()}
    return sd


def checkpoint_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    C = cfg.hidden_size
    shapes = {"backbone.embeddings.weight": (cfg.vocab_size, C), "backbone.norm_f.weight": (C,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, C)
    for _, names in _layers(cfg):
        shapes |= {n: shape for parts in names.values() for n, shape in parts}
    return shapes


def ignored(cfg: ModelConfig, name: str) -> bool:
    """The multi-token-prediction layers some checkpoints carry (mtp.*): left out, as transformers leaves them."""
    return name.startswith("mtp.")


def _layers(cfg: ModelConfig) -> list[tuple[str, dict[str, list[tuple[str, tuple[int, ...]]]]]]:
    """Per layer of ours: (our prefix, our tensor -> its checkpoint tensors (name, shape))."""
    C, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * D, cfg.num_key_value_heads * D
    out = []
    for j, (i, mlp) in enumerate(pairs(cfg)):
        p = f"backbone.layers.{i}."
        names = {"attention_norm.weight": [(p + "norm.weight", (C,))]}
        if cfg.layer(j).keeps_kv:
            m = p + "mixer."
            names |= {"attention.wqkv.weight": [(m + "q_proj.weight", (q, C)), (m + "k_proj.weight", (kv, C)),
                                                (m + "v_proj.weight", (kv, C))],
                      "attention.wo.weight": [(m + "o_proj.weight", (C, q))]}
        else:  # Mamba2Mixer's names under model.layers.{j}.mamba. -> the checkpoint's backbone.layers.{i}.mixer.
            own = f"model.layers.{j}.mamba."
            names |= {"attention." + k: [(p + "mixer." + n[len(own):], s) for n, s in v]
                      for k, v in Mamba2Mixer.checkpoint(cfg, j).items()}
        if mlp is not None and cfg.moe is not None and cfg.moe.sparse_layers[j]:
            names |= _moe_names(cfg, f"backbone.layers.{mlp}.")
        elif mlp is not None:
            f = f"backbone.layers.{mlp}."
            names |= {"ffn_norm.weight": [(f + "norm.weight", (C,))],
                      "mlp.w1.weight": [(f + "mixer.up_proj.weight", (I, C))],
                      "mlp.w2.weight": [(f + "mixer.down_proj.weight", (C, I))]}
            if cfg.mlp_bias:
                names |= {"mlp.w1.bias": [(f + "mixer.up_proj.bias", (I,))],
                          "mlp.w2.bias": [(f + "mixer.down_proj.bias", (C,))]}
        out.append((f"layers.{j}.", names))
    return out


def _moe_names(cfg: ModelConfig, f: str) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """A MoE layer's tensors: model/moe.py's names -> the checkpoint's (name, shape)."""
    assert cfg.moe is not None
    C, E, J, S = cfg.hidden_size, cfg.moe.num_experts, cfg.moe.intermediate_size, cfg.moe.shared_intermediate_size
    m = f + "mixer."
    names = {"ffn_norm.weight": [(f + "norm.weight", (C,))], "mlp.gate.weight": [(m + "gate.weight", (E, C))],
             "mlp.correction": [(m + "gate.e_score_correction_bias", (E,))],
             "mlp.shared.w1.weight": [(m + "shared_experts.up_proj.weight", (S, C))],
             "mlp.shared.w2.weight": [(m + "shared_experts.down_proj.weight", (C, S))]}
    if cfg.mlp_bias:
        names |= {"mlp.shared.w1.bias": [(m + "shared_experts.up_proj.bias", (S,))],
                  "mlp.shared.w2.bias": [(m + "shared_experts.down_proj.bias", (C,))]}
    for e in range(E):
        names |= {f"mlp.experts.{e}.w1.weight": [(m + f"experts.{e}.up_proj.weight", (J, C))],
                  f"mlp.experts.{e}.w2.weight": [(m + f"experts.{e}.down_proj.weight", (C, J))]}
    return names
