"""Granite 4.0-H (transformers' granitemoehybrid): Mamba2 layers (model/recurrent/ssd.py) between attention layers
(`layer_types` 'mamba' / 'attention', transformers 5's 'linear_attention' / 'full_attention'), Granite 3's four
multipliers, attention without RoPE unless `position_embedding_type` is 'rope', and a gated MLP of
`shared_intermediate_size` (`shared_mlp.input_linear` = [gate; up], `output_linear`). The MoE variants
(num_local_experts > 0: Granite 4.0-H Tiny / Small) add `block_sparse_moe`: a router (top k of the logits, softmax
over those k) over experts stacked per layer (`input_linear` (E, 2I, C) = [gate; up] rows, `output_linear` (E, C, I);
model/weights/stacked.py unstacks them), the shared MLP beside them as an ungated shared expert."""

from __future__ import annotations

from typing import Any

from ..errors import ModelLoadError
from .base import FULL, NOPE, STATE_SPACE, Family, GGUFMeta

def _number(value: Any) -> float:
    """A float of config.json: a number, "Infinity", or transformers 5's {"__float__": "Infinity"}."""
    return float(value["__float__"] if isinstance(value, dict) else value)


_KINDS = {"mamba": "mamba", "linear_attention": "mamba", "attention": "attention", "full_attention": "attention"}


def _granite_hybrid(raw: dict[str, Any], source: str, layers: int) -> dict[str, Any]:
    types = raw.get("layer_types") or raw.get("layers_block_type") or ["mamba"] * layers
    if len(types) != layers or not set(types) <= set(_KINDS):
        raise ModelLoadError(f"{source}: layer_types must name 'mamba' or 'attention' for each of the {layers} "
                             f"layers, got {types!r}")
    attention = FULL if raw.get("position_embedding_type") == "rope" else NOPE
    hidden, heads = int(raw["hidden_size"]), int(raw.get("mamba_n_heads", 128))
    inner = int(raw.get("mamba_expand", 2)) * hidden
    head_dim = raw.get("mamba_d_head", "auto")
    head_dim = inner // heads if head_dim in (None, "auto") else int(head_dim)
    if head_dim * heads != inner:
        raise ModelLoadError(f"{source}: mamba_n_heads x mamba_d_head must be mamba_expand x hidden_size ({inner})")
    groups = int(raw.get("mamba_n_groups", 1))
    limit = raw.get("time_step_limit") or (0.0, float("inf"))
    rec = {"conv_kernel": int(raw.get("mamba_d_conv", 4)), "conv_bias": bool(raw.get("mamba_conv_bias", True)),
           "mamba_num_heads": heads, "mamba_head_dim": head_dim, "mamba_state_size": int(raw.get("mamba_d_state", 256)),
           "mamba_n_groups": groups, "mamba_chunk_size": int(raw.get("mamba_chunk_size", 256)),
           "mamba_proj_bias": bool(raw.get("mamba_proj_bias", False)),
           "time_step_limit": (_number(limit[0]), _number(limit[1])), "mamba_norm_groups": groups}
    out = {"layers": tuple(STATE_SPACE if _KINDS[t] == "mamba" else attention for t in types),
            "embedding_multiplier": float(raw.get("embedding_multiplier", 1.0)),
            "attention_multiplier": float(raw.get("attention_multiplier", 1.0)),
            "residual_multiplier": float(raw.get("residual_multiplier", 1.0)),
            "logits_scaling": float(raw.get("logits_scaling", 1.0)),
            "intermediate_size": int(raw.get("shared_intermediate_size", 1024)), "recurrent": rec}
    experts = int(raw.get("num_local_experts") or 0)
    if experts > 0:  # GraniteMoeHybridMoE beside the shared MLP on every layer
        out["moe"] = dict(num_experts=experts, top_k=raw.get("num_experts_per_tok"),
                          intermediate_size=int(raw.get("intermediate_size", 1024)), norm_topk_prob=False,
                          router_weights_float32=False, shared_intermediate_size=out["intermediate_size"],
                          shared_gate=False, softmax_after_topk=True, sparse_layers=(True,) * layers)
    return out


def _gguf(g: GGUFMeta, cfg: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's granitehybrid keys: a KV head count per layer (0: a Mamba2 layer), the ssm.* sizes (time_step_rank
    is the head count), Granite's scales; its converter turns RoPE off for hybrids (rope.scaling.finetuned)."""
    layers, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    kv = g.get("attention.head_count_kv")
    kv = kv if isinstance(kv, list) else [kv] * layers
    heads, inner = int(g.get("ssm.time_step_rank")), int(g.get("ssm.inner_size"))
    first = next((i for i, k in enumerate(kv) if not k), 0)
    return {"layer_types": ["attention" if k else "mamba" for k in kv], "num_local_experts": int(g.get("expert_count", 0)),
            "num_experts_per_tok": int(g.get("expert_used_count") or 0),
            "shared_intermediate_size": int(g.get("expert_shared_feed_forward_length") or cfg["intermediate_size"]),
            "mamba_n_heads": heads, "mamba_d_head": inner // heads, "mamba_expand": inner // hidden,
            "mamba_d_state": int(g.get("ssm.state_size")), "mamba_n_groups": int(g.get("ssm.group_count", 1)),
            "mamba_d_conv": int(g.get("ssm.conv_kernel", 4)),
            "mamba_conv_bias": f"blk.{first}.ssm_conv1d.bias" in g.tensors,
            "mamba_proj_bias": f"blk.{first}.ssm_in.bias" in g.tensors,
            "position_embedding_type": "rope" if g.get("rope.scaling.finetuned") else "nope",
            "embedding_multiplier": float(g.get("embedding_scale", 1.0)),
            "residual_multiplier": float(g.get("residual_scale", 1.0)),
            "attention_multiplier": float(g.get("attention.scale", cfg["head_dim"] ** -0.5)),
            "logits_scaling": float(g.get("logit_scale", 1.0))}


GRANITE_HYBRID = Family(
    "GraniteMoeHybridForCausalLM", ("granitemoehybrid",), "Granite 4.0-H Micro, Tiny, Small",
    "Mamba2 layers (`layer_types` 'mamba': a convolution window and a head_dim x state_size matrix per head per "
    "sequence) between attention layers; Granite's multipliers; no RoPE unless `position_embedding_type` 'rope'; "
    "the MLP from `shared_mlp` (`shared_intermediate_size`), beside `num_local_experts` experts (top k, softmax "
    "over the k) where it has them",
    read=_granite_hybrid, tensor_parallel=False, gguf="granitehybrid", read_gguf=_gguf,
    gguf_permuted=True, stacked_experts=True,
    gguf_aliases=((r"\.mamba\.dt_bias$", ".mamba.dt_proj.bias"),),
    gguf_joined=(("mlp.gate_up_proj.weight", ("ffn_gate.weight", "ffn_up.weight")),),  # [gate; up] written as two
    renames=((r"\.shared_mlp\.input_linear\.", ".mlp.gate_up_proj."),
             (r"\.shared_mlp\.output_linear\.", ".mlp.down_proj."), (r"\.block_sparse_moe\.", ".mlp.")),
    state="a convolution window and a Mamba2 state matrix per head",
)
