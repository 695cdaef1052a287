"""Nemotron-H (NVIDIA's Nemotron-H 4B-56B, Nemotron Nano 2; transformers' nemotron_h): each layer ONE of a Mamba2
mixer ('M'), attention without RoPE ('*') or a squared-ReLU MLP ('-'), by `hybrid_override_pattern` (transformers
5's `layers_block_type`: 'linear_attention' / 'full_attention' / 'mlp'), each norm -> it -> residual; `backbone.*`
names. Its own network (model/nemotron_h.py) pairs each MLP layer with the mixer before it, so our layers are the
mixers (num_hidden_layers counts them). Nemotron 3's MoE layers ('E') take an MLP layer's place: DeepSeek-V3's
sigmoid router (GLM-4 MoE's: a correction bias for the choice, group-limited, renormalised, x routed_scaling_factor)
over squared-ReLU experts (up, relu^2, down: no gate; mixer.experts.{e}.up_proj / down_proj in the checkpoint),
plus one ungated squared-ReLU shared expert. A latent projection around the experts (`moe_latent_size`) is refused by name."""

from __future__ import annotations

from typing import Any

from ..errors import ModelLoadError
from .base import NOPE, STATE_SPACE, Family, GGUFMeta

_CHARS = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*", "mlp": "-", "moe": "E"}


def _number(value: Any) -> float:
    return float(value["__float__"] if isinstance(value, dict) else value)


def _pattern(raw: dict[str, Any], source: str) -> str:
    types = raw.get("layers_block_type") or raw.get("layer_types")
    pattern = "".join(_CHARS.get(t, "?") for t in types) if types else raw.get("hybrid_override_pattern")
    if not pattern or not set(pattern) <= set("M*-E"):
        raise ModelLoadError(f"{source}: Nemotron-H needs hybrid_override_pattern (or layers_block_type) of 'M', "
                             f"'*', '-' per layer, got {pattern or types!r}")
    if pattern[0] in "-E" or any(a in "-E" and b in "-E" for a, b in zip(pattern, pattern[1:])):
        raise ModelLoadError(f"{source}: an MLP or MoE layer must follow a Mamba2 or attention layer in {pattern!r}")
    return pattern


def _nemotron_h(raw: dict[str, Any], source: str, layers: int) -> dict[str, Any]:
    pattern = _pattern(raw, source)
    for key, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        if raw.get(key, want) != want:
            raise ModelLoadError(f"{source}: {key} {raw[key]!r} is not supported (only {want!r})")
    heads, head_dim = int(raw.get("mamba_num_heads", 128)), int(raw.get("mamba_head_dim", 64))
    groups = int(raw.get("n_groups", raw.get("mamba_n_groups", 8)))
    limit = raw.get("time_step_limit") or (0.0, float("inf"))
    rec = {"conv_kernel": int(raw.get("conv_kernel", 4)), "conv_bias": bool(raw.get("use_conv_bias", True)),
           "mamba_num_heads": heads, "mamba_head_dim": head_dim, "mamba_state_size": int(raw.get("ssm_state_size", 128)),
           "mamba_n_groups": groups, "mamba_chunk_size": int(raw.get("chunk_size", 128)),
           "mamba_proj_bias": bool(raw.get("use_bias", False)),
           "time_step_limit": (_number(limit[0]), _number(limit[1])), "mamba_norm_groups": groups}
    mixers = [c for c in pattern if c not in "-E"]
    out = {"num_hidden_layers": len(mixers), "layers": tuple(STATE_SPACE if c == "M" else NOPE for c in mixers),
           "layer_pattern": pattern, "recurrent": rec, "rms_norm_eps": float(raw.get("layer_norm_epsilon", 1e-5)),
           "intermediate_size": int(raw.get("intermediate_size", 21504))}
    if "E" in pattern:
        out["moe"] = _moe(raw, source, pattern)
    return out


def _moe(raw: dict[str, Any], source: str, pattern: str) -> dict[str, Any]:
    """Nemotron 3's MoE layers (transformers' NemotronHMoE / NemotronHTopkRouter), on each of our layers whose
    mixer an 'E' follows."""
    if raw.get("moe_latent_size") is not None:
        raise ModelLoadError(f"{source}: Nemotron-H's MoE latent projection (moe_latent_size="
                             f"{raw['moe_latent_size']}) is not supported yet; MoE layers without it are")
    experts = int(raw.get("n_routed_experts") or raw.get("num_local_experts") or 8)
    groups, top_groups = int(raw.get("n_group") or 1), int(raw.get("topk_group") or 1)
    if experts % groups or not 1 <= top_groups <= groups or (groups > 1 and experts // groups < 2):
        raise ModelLoadError(f"{source}: n_group={groups} must split n_routed_experts={experts} into groups of at "
                             f"least 2, and topk_group={top_groups} be between 1 and n_group")
    sparse = tuple(i + 1 < len(pattern) and pattern[i + 1] == "E" for i, c in enumerate(pattern) if c not in "-E")
    return dict(num_experts=experts, top_k=int(raw.get("num_experts_per_tok", 2)),
                intermediate_size=int(raw.get("moe_intermediate_size", 7688)),
                norm_topk_prob=bool(raw.get("norm_topk_prob", True)), router_weights_float32=True,
                shared_intermediate_size=int(raw.get("moe_shared_expert_intermediate_size", 7688)),
                sparse_layers=sparse, scoring="sigmoid", correction_bias=True, n_group=groups,
                topk_group=top_groups, routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
                shared_gate=False)


def _gguf_kind(g: GGUFMeta, i: int) -> str:
    """Block i's kind in a GGUF file, by the tensors it has: 'M' (ssm_in), '*' (attn_q), 'E' (experts), '-'."""
    has = lambda name: f"blk.{i}.{name}.weight" in g.tensors  # noqa: E731
    return "M" if has("ssm_in") else "*" if has("attn_q") else "E" if has("ffn_gate_inp") else "-"


def _gguf(g: GGUFMeta, cfg: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's nemotron_h (and nemotron_h_moe) keys: the layer pattern from each block's tensors (the per-layer
    KV heads and MLP widths are 0 for the other kinds; the _moe architecture, which the converter writes when
    transformers fills in MoE defaults, leaves the MLP widths 0 too), the Mamba2 sizes under ssm.* (time_step_rank:
    the heads), the MLP width from the first MLP block's ffn_up."""
    pattern = "".join(_gguf_kind(g, i) for i in range(int(g.get("block_count"))))
    heads, inner = int(g.get("ssm.time_step_rank")), int(g.get("ssm.inner_size"))
    first = pattern.find("M")
    mlp = pattern.find("-")
    width = int(g.tensors[f"blk.{mlp}.ffn_up.weight"].shape[-1]) if mlp >= 0 else cfg["intermediate_size"]
    return {"hybrid_override_pattern": pattern, "mamba_num_heads": heads, "mamba_head_dim": inner // heads,
            "n_groups": int(g.get("ssm.group_count", 1)), "ssm_state_size": int(g.get("ssm.state_size")),
            "conv_kernel": int(g.get("ssm.conv_kernel", 4)), "use_conv_bias": f"blk.{first}.ssm_conv1d.bias" in g.tensors,
            "use_bias": f"blk.{first}.ssm_in.bias" in g.tensors, "intermediate_size": width,
            "layer_norm_epsilon": float(g.get("attention.layer_norm_epsilon", 1e-5))}


NEMOTRON_H = Family(
    "NemotronHForCausalLM", ("nemotron_h",), "Nemotron-H (4B-56B), Nemotron Nano 2, Nemotron 3 Nano",
    "each layer one of a Mamba2 mixer (a convolution window and a head_dim x state_size matrix per head per "
    "sequence), NoPE attention, a squared-ReLU MLP or (Nemotron 3) a MoE of squared-ReLU experts, by "
    "`hybrid_override_pattern`",
    read=_nemotron_h, network="nemotron_h", tensor_parallel=False,
    gguf="nemotron_h", gguf_also=("nemotron_h_moe",), read_gguf=_gguf,
    gguf_aliases=((r"\.mixer\.dt_bias$", ".mixer.dt_proj.bias"),),
    config_defaults=(("num_hidden_layers", 0),),
    # transformers 5's modules (and so PEFT's adapter keys) are model.layers.*; the checkpoints' backbone.layers.*
    renames=((r"^model\.layers\.", "backbone.layers."),),
    state="a convolution window and a Mamba2 state matrix per head",
)
