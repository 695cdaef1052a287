"""Mixtral: Llama's attention with a sparse MoE MLP on every layer (softmax router, top k renormalised, the
weights in float32), under `block_sparse_moe` with experts' w1 / w3 / w2. llama.cpp writes it as a `llama` file
with experts (llama.py reads that)."""

from __future__ import annotations

from typing import Any

from .base import Family
from .reading import every_layer_slides


def _mixtral(raw: dict[str, Any], source: str, layers: int) -> dict[str, Any]:
    moe = dict(num_experts=raw.get("num_local_experts"), top_k=raw.get("num_experts_per_tok"),
               intermediate_size=int(raw["intermediate_size"]), norm_topk_prob=True, router_weights_float32=True,
               shared_intermediate_size=0, sparse_layers=(True,) * layers)
    return {"moe": moe, **every_layer_slides(raw, source, layers)}


MIXTRAL = Family(
    "MixtralForCausalLM", ("mixtral",), "Mixtral 8x7B",
    "a sparse MoE MLP on every layer: softmax router, top k, renormalised over the k, weights kept in float32",
    read=_mixtral, moe_prefix="block_sparse_moe.", expert_names=("w1", "w3", "w2"),
)
