"""LFM2-MoE (Liquid AI's LFM2-8B-A1B; transformers' lfm2_moe): LFM2's layers (families/lfm2.py: gated short
convolutions between attention layers with per-head q/k norms) whose first `num_dense_layers` have a dense SwiGLU MLP
of `intermediate_size` and the rest a sparse one: sigmoid router scores, the top k chosen by score + a per-expert
`expert_bias` (float32), their plain scores as weights, renormalised (+ 1e-6) where `norm_topk_prob`, times
`routed_scaling_factor`. transformers' configuration_lfm2_moe.py / modeling_lfm2_moe.py."""

from __future__ import annotations

from typing import Any

from ..errors import ModelLoadError
from .base import Family, GGUFMeta
from .lfm2 import LFM2, _gguf as _lfm2_gguf, _lfm2


def _lfm2_moe(raw: dict[str, Any], source: str, layers: int) -> dict[str, Any]:
    out = _lfm2({**raw, "block_auto_adjust_ff_dim": False}, source, layers)
    dense = int(raw.get("num_dense_layers", 2))
    if not 0 <= dense <= layers:
        raise ModelLoadError(f"{source}: num_dense_layers must be between 0 and num_hidden_layers ({layers}), got {dense}")
    out["intermediate_size"] = int(raw.get("intermediate_size", 7168))
    out["moe"] = dict(num_experts=raw.get("num_experts", 32), top_k=raw.get("num_experts_per_tok", 4),
                      intermediate_size=int(raw.get("moe_intermediate_size", 1792)),
                      norm_topk_prob=bool(raw.get("norm_topk_prob", True)), router_weights_float32=True,
                      scoring="sigmoid", correction_bias=bool(raw.get("use_expert_bias", True)),
                      routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)), topk_norm_eps=1e-6,
                      sparse_layers=tuple(i >= dense for i in range(layers)))
    return out


def _gguf(g: GGUFMeta, cfg: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's lfm2moe keys: LFM2's, the experts' counts and width, the dense layers before them; the expert bias
    where the file has it (blk.N.exp_probs_b)."""
    dense = int(g.get("leading_dense_block_count", 0))
    return {**_lfm2_gguf(g, cfg), "intermediate_size": cfg["intermediate_size"], "num_dense_layers": dense,
            "num_experts": int(g.get("expert_count")), "num_experts_per_tok": int(g.get("expert_used_count")),
            "moe_intermediate_size": int(g.get("expert_feed_forward_length")),
            "norm_topk_prob": bool(g.get("expert_weights_norm", True)),
            "routed_scaling_factor": float(g.get("expert_weights_scale") or 1.0),
            "use_expert_bias": f"blk.{dense}.exp_probs_b.bias" in g.tensors}


LFM2_MOE = Family(
    "Lfm2MoeForCausalLM", ("lfm2_moe",), "LFM2-8B-A1B",
    "LFM2's short-convolution and attention layers; after the first `num_dense_layers`, a sparse MLP: sigmoid "
    "router, top k by score + `expert_bias`, weights renormalised",
    read=_lfm2_moe, tensor_parallel=False, gguf="lfm2moe", read_gguf=_gguf,
    gguf_aliases=LFM2.gguf_aliases,
    moe_prefix="feed_forward.", expert_names=("w1", "w3", "w2"),
    renames=LFM2.renames + ((r"\.feed_forward\.expert_bias$", ".feed_forward.gate.e_score_correction_bias"),),
    state=LFM2.state,
)
