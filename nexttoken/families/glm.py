"""GLM-4.5 / 4.6 MoE (`glm4_moe`): Llama's block with q/k/v biases (`attention_bias`: o has none), optional
per-head q/k norms (`use_qk_norm`), partial RoPE (the first `partial_rotary_factor` = half of each head rotates,
NeoX halves), dense MLPs in the first `first_k_dense_replace` layers and a MoE MLP after: DeepSeek-V3's router
(sigmoid scores, a per-expert `e_score_correction_bias` that moves the choice only, the choice limited to the
`topk_group` best of `n_group` groups, weights renormalised and x `routed_scaling_factor`) plus `n_shared_experts`
always-on experts as one ungated MLP. transformers' configuration_glm4_moe.py / modeling_glm4_moe.py.

The checkpoints carry `num_nextn_predict_layers` multi-token-prediction layers after the last one
(model.layers.{num_hidden_layers}...): transformers leaves them out, and so do we (loader.py); llama.cpp counts them in
its block_count and writes `nextn_predict_layers`. The fused native step computes the sigmoid router
(ROUTE_SIGMOID, csrc/decode.cpp's route) and the partial RoPE (NtModel.rotary_dim).
"""

from __future__ import annotations

from typing import Any

from ..errors import ModelLoadError
from .base import Family, GGUFMeta
from .reading import gguf_need


def _glm4_moe(raw: dict[str, Any], source: str, layers: int) -> dict[str, Any]:
    experts = raw.get("n_routed_experts") or raw.get("num_local_experts")
    groups, top_groups = int(raw.get("n_group") or 1), int(raw.get("topk_group") or 1)
    if not (isinstance(experts, int) and experts % groups == 0 and 1 <= top_groups <= groups
            and (groups == 1 or experts // groups >= 2)):
        raise ModelLoadError(f"{source}: n_group={groups} must split n_routed_experts={experts} into groups of at "
                             f"least 2, and topk_group={top_groups} be between 1 and n_group")
    first = int(raw.get("first_k_dense_replace", 1))
    width = int(raw["moe_intermediate_size"])
    moe = dict(num_experts=experts, top_k=raw.get("num_experts_per_tok"), intermediate_size=width,
               norm_topk_prob=bool(raw.get("norm_topk_prob", True)), router_weights_float32=True,
               shared_intermediate_size=width * int(raw.get("n_shared_experts") or 0),
               sparse_layers=tuple(i >= first for i in range(layers)), scoring="sigmoid", correction_bias=True,
               n_group=groups, topk_group=top_groups, routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
               shared_gate=False)
    params = dict(raw.get("rope_parameters") or {})
    if not params:  # older configs: rope_theta and partial_rotary_factor at the top
        params = {"rope_type": "default", "rope_theta": raw.get("rope_theta", 10000.0)}
    params.setdefault("partial_rotary_factor", raw.get("partial_rotary_factor", 0.5))  # transformers' default
    return {"moe": moe, "qkv_bias": bool(raw.get("attention_bias", False)), "attention_bias": False,
            "qk_norm": "head" if raw.get("use_qk_norm") else None, "rope": {**raw, "rope_parameters": params}}


def _gguf(g: GGUFMeta, cfg: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's glm4moe keys; its block_count counts the MTP layers, which nexttoken does not run."""
    head_dim = cfg["head_dim"]
    rotary = int(g.get("rope.dimension_count") or head_dim // 2)
    return {"num_hidden_layers": cfg["num_hidden_layers"] - int(g.get("nextn_predict_layers") or 0),
            "n_routed_experts": int(gguf_need(g, "expert_count")),
            "num_experts_per_tok": int(gguf_need(g, "expert_used_count")),
            "moe_intermediate_size": int(gguf_need(g, "expert_feed_forward_length")),
            "n_shared_experts": int(g.get("expert_shared_count") or 0),
            "first_k_dense_replace": int(g.get("leading_dense_block_count") or 0),
            "routed_scaling_factor": float(g.get("expert_weights_scale") or 1.0),
            "norm_topk_prob": bool(g.get("expert_weights_norm", True)),
            "n_group": int(g.get("expert_group_count") or 1), "topk_group": int(g.get("expert_group_used_count") or 1),
            "attention_bias": "blk.0.attn_q.bias" in g.tensors, "use_qk_norm": "blk.0.attn_q_norm.weight" in g.tensors,
            "rope_parameters": {**cfg["rope_parameters"], "partial_rotary_factor": rotary / head_dim}}


GLM4_MOE = Family(
    "Glm4MoeForCausalLM", ("glm4_moe",), "GLM-4.5, GLM-4.5-Air, GLM-4.6",
    "q/k/v bias (`attention_bias`), per-head q/k norms (`use_qk_norm`); partial RoPE (`partial_rotary_factor`, 0.5); "
    "dense MLPs in the first `first_k_dense_replace` layers, then a MoE: sigmoid router with "
    "`e_score_correction_bias` for the choice, `n_group` / `topk_group` group-limited routing, "
    "`routed_scaling_factor`, `n_shared_experts` ungated shared experts; the MTP layers left out",
    read=_glm4_moe, gguf="glm4moe", read_gguf=_gguf, shared_expert="shared_experts",
    mtp_layers=True,
)
