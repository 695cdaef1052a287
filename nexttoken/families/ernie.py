"""ERNIE 4.5 (`ernie4_5`, dense) and ERNIE 4.5 MoE (`ernie4_5_moe`): Llama's block with biases on every projection
where `use_bias`, and RoPE over adjacent pairs of each head's dims (GPT-J's interleaved rotation: dims 2i, 2i+1
rotate by angle i) instead of NeoX's halves (i, i + D/2). The loader reorders each head's q / k rows from pairs into
halves (rope_pairs), which rotates the same values and leaves every q.k product unchanged (a permutation of the dims
summed over), so the modules, the fused native step, the pool and tensor parallelism run it as a Llama block.

The MoE: sparse layers every `moe_layer_interval` from `moe_layer_start_index` to `moe_layer_end_index` (the others
a dense MLP of intermediate_size); a float32 softmax router whose per-expert `moe_statics.e_score_correction_bias`
moves the choice only, the chosen probabilities renormalised; `moe_num_shared_experts` always-on experts as one
ungated MLP (the native step's ROUTE_SOFTMAX with NtLayer.correction, shared_gate NULL). transformers' modeling_ernie4_5.py / modeling_ernie4_5_moe.py; llama.cpp's `ernie4_5` and
`ernie4_5-moe` (the rows as the checkpoint has them: llama.cpp rotates pairs too).
"""

from __future__ import annotations

from typing import Any

from ..errors import ModelLoadError
from .base import Family, GGUFMeta
from .reading import gguf_need


def _bias(raw: dict[str, Any]) -> dict[str, Any]:
    bias = bool(raw.get("use_bias", False))
    return {"attention_bias": bias, "mlp_bias": bias}


def _ernie4_5_moe(raw: dict[str, Any], source: str, layers: int) -> dict[str, Any]:
    if raw.get("use_bias"):
        raise ModelLoadError(f"{source}: ERNIE 4.5 MoE with use_bias=true is not supported (its experts have no "
                             "biases in transformers either); the released checkpoints set use_bias=false")
    start, interval = int(raw.get("moe_layer_start_index", 1)), int(raw.get("moe_layer_interval", 1))
    end = raw.get("moe_layer_end_index", -1)
    end = layers - 1 if end in (None, -1) else int(end)
    if interval < 1:
        raise ModelLoadError(f"{source}: moe_layer_interval must be >= 1, got {interval}")
    width = int(raw["moe_intermediate_size"])
    moe = dict(num_experts=raw.get("moe_num_experts"), top_k=raw.get("moe_k"), intermediate_size=width,
               norm_topk_prob=True, router_weights_float32=False,
               shared_intermediate_size=width * int(raw.get("moe_num_shared_experts") or 0), shared_gate=False,
               correction_bias=True,
               sparse_layers=tuple((i + 1) % interval == 0 and start <= i <= end for i in range(layers)))
    return {"moe": moe}


def _gguf_moe(g: GGUFMeta, cfg: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's ernie4_5-moe keys (its leading_dense_block_count is moe_layer_start_index)."""
    return {"moe_num_experts": int(gguf_need(g, "expert_count")), "moe_k": int(gguf_need(g, "expert_used_count")),
            "moe_intermediate_size": int(gguf_need(g, "expert_feed_forward_length")),
            "moe_num_shared_experts": int(g.get("expert_shared_count") or 0),
            "moe_layer_start_index": int(g.get("leading_dense_block_count") or 0),
            "moe_layer_interval": int(g.get("interleave_moe_layer_step") or 1)}


def _gguf_dense(g: GGUFMeta, cfg: dict[str, Any]) -> dict[str, Any]:
    return {"use_bias": "blk.0.attn_q.bias" in g.tensors}


ERNIE4_5 = Family(
    "Ernie4_5ForCausalLM", ("ernie4_5",), "ERNIE 4.5 0.3B",
    "RoPE over adjacent pairs of dims (q / k rows reordered at load); biases everywhere (`use_bias`)",
    read=lambda raw, source, layers: _bias(raw), gguf="ernie4_5", read_gguf=_gguf_dense, rope_pairs=True,
    gguf_permuted=True,
)
ERNIE4_5_MOE = Family(
    "Ernie4_5_MoeForCausalLM", ("ernie4_5_moe",), "ERNIE 4.5 21B-A3B, 300B-A47B",
    "ERNIE 4.5's block; MoE layers (`moe_layer_start_index` / `_interval` / `_end_index`): softmax router with "
    "a correction bias for the choice, renormalised, `moe_num_shared_experts` ungated shared experts",
    read=_ernie4_5_moe, gguf="ernie4_5-moe", read_gguf=_gguf_moe, rope_pairs=True,
    gguf_permuted=True,
    shared_expert="shared_experts", correction_bias="moe_statics.e_score_correction_bias", correction_rows=True,
)
