"""Falcon-H1 (TII's Falcon-H1 0.5B-34B; transformers' falcon_h1): every layer runs attention (RoPE) and a Mamba2
mixer side by side on the same normed input, adds both to the residual, then a gated MLP; µP multipliers throughout
(`key_multiplier`, `attention_in/out_multiplier`, `ssm_in/out_multiplier`, the five `ssm_multipliers` of the
in_proj's parts, `mlp_multipliers`, `embedding_multiplier`, `lm_head_multiplier`). Its own network
(model/falcon_h1.py): layer i of the checkpoint is our layers 2i (the Mamba2 mixer: a state slot) and 2i + 1 (the
attention: K/V). transformers' configuration_falcon_h1.py / modeling_falcon_h1.py."""

from __future__ import annotations

from typing import Any

from ..errors import ModelLoadError
from .base import FULL, STATE_SPACE, Family, GGUFMeta


def _number(value: Any) -> float:
    return float(value["__float__"] if isinstance(value, dict) else value)


def _falcon_h1(raw: dict[str, Any], source: str, layers: int) -> dict[str, Any]:
    hidden, heads = int(raw["hidden_size"]), int(raw.get("mamba_n_heads", 128))
    inner = raw.get("mamba_d_ssm")
    inner = int(raw.get("mamba_expand", 2)) * hidden if inner is None else int(inner)
    head_dim = raw.get("mamba_d_head", "auto")
    head_dim = inner // heads if head_dim in (None, "auto") else int(head_dim)
    if head_dim * heads != inner:
        raise ModelLoadError(f"{source}: mamba_n_heads x mamba_d_head must be mamba_d_ssm ({inner})")
    if bool(raw.get("mamba_proj_bias", False)) != bool(raw.get("projectors_bias", False)):
        raise ModelLoadError(f"{source}: mamba_proj_bias and projectors_bias differ; nexttoken reads Falcon-H1's "
                             "Mamba2 in_proj and out_proj with one bias setting")
    if raw.get("mamba_rms_norm", False) and not raw.get("mamba_norm_before_gate", True):
        raise ModelLoadError(f"{source}: mamba_norm_before_gate false with mamba_rms_norm is not supported")
    groups = int(raw.get("mamba_n_groups", 1))
    limit = raw.get("time_step_limit") or (0.0, float("inf"))
    rec = {"conv_kernel": int(raw.get("mamba_d_conv", 4)), "conv_bias": bool(raw.get("mamba_conv_bias", True)),
           "mamba_num_heads": heads, "mamba_head_dim": head_dim, "mamba_state_size": int(raw.get("mamba_d_state", 256)),
           "mamba_n_groups": groups, "mamba_chunk_size": int(raw.get("mamba_chunk_size", 256)),
           "mamba_proj_bias": bool(raw.get("mamba_proj_bias", False)),
           "time_step_limit": (_number(limit[0]), _number(limit[1])), "mamba_norm_groups": groups}
    ssm = tuple(float(m) for m in (raw.get("ssm_multipliers") or (1.0,) * 5))
    mlp = tuple(float(m) for m in (raw.get("mlp_multipliers") or (1.0, 1.0)))
    if len(ssm) != 5 or len(mlp) != 2:
        raise ModelLoadError(f"{source}: ssm_multipliers needs 5 numbers and mlp_multipliers 2, got {ssm} and {mlp}")
    mup = {"key": float(raw.get("key_multiplier", 1.0)), "attention_in": float(raw.get("attention_in_multiplier", 1.0)),
           "attention_out": float(raw.get("attention_out_multiplier", 1.0)),
           "ssm_in": float(raw.get("ssm_in_multiplier", 1.0)), "ssm_out": float(raw.get("ssm_out_multiplier", 1.0)),
           "ssm": ssm, "mlp": mlp, "mamba_rms_norm": bool(raw.get("mamba_rms_norm", False))}
    return {"num_hidden_layers": 2 * layers, "layers": (STATE_SPACE, FULL) * layers, "recurrent": rec, "mup": mup,
            "rms_norm_eps": float(raw.get("rms_norm_eps", 1e-5)),
            "embedding_multiplier": float(raw.get("embedding_multiplier", 1.0)),
            "logits_scaling": 1.0 / float(raw.get("lm_head_multiplier", 1.0))}


def _gguf(g: GGUFMeta, cfg: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's falcon-h1 keys: the Mamba2 sizes under ssm.* (time_step_rank: the head count). The converter
    writes none of the µP multipliers: it multiplies them into the weights (q/k/v by attention_in, k by key too,
    o by attention_out, the in_proj's five parts by ssm_in and ssm_multipliers, out_proj by ssm_out, gate and down
    by mlp_multipliers, the embeddings and LM head by theirs), so the file reads as a checkpoint whose multipliers
    are all 1. The Mamba2 norm, the biases: where the file has their tensors."""
    heads, inner = int(g.get("ssm.time_step_rank")), int(g.get("ssm.inner_size"))
    bias = "blk.0.ssm_in.bias" in g.tensors
    return {"mamba_n_heads": heads, "mamba_d_ssm": inner, "mamba_d_head": inner // heads,
            "mamba_d_state": int(g.get("ssm.state_size")), "mamba_n_groups": int(g.get("ssm.group_count", 1)),
            "mamba_d_conv": int(g.get("ssm.conv_kernel", 4)), "mamba_conv_bias": "blk.0.ssm_conv1d.bias" in g.tensors,
            "mamba_proj_bias": bias, "projectors_bias": bias, "mamba_rms_norm": "blk.0.ssm_norm.weight" in g.tensors}


FALCON_H1 = Family(
    "FalconH1ForCausalLM", ("falcon_h1",), "Falcon-H1 (0.5B-34B)",
    "attention and a Mamba2 mixer side by side in every layer (a convolution window and a head_dim x state_size "
    "matrix per head per sequence, beside the layer's K/V), then a gated MLP; µP multipliers",
    read=_falcon_h1, network="falcon_h1", tensor_parallel=False,
    gguf="falcon-h1", read_gguf=_gguf, gguf_aliases=((r"\.mamba\.dt_bias$", ".mamba.dt_proj.bias"),),
    state="a convolution window and a Mamba2 state matrix per head, beside each layer's K/V",
)
