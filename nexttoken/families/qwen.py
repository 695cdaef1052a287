"""Qwen2, Qwen2.5, Qwen3 and their mixtures of experts: Llama's block with q/k/v biases (Qwen2) or per-head q/k
norms (Qwen3), optional sliding layers, and sparse MLP layers (reading.qwen_moe). llama.cpp uses NeoX RoPE for them:
no q / k permutation."""

from __future__ import annotations

from typing import Any

from .base import Family, GGUFMeta
from .reading import gguf_need, gguf_qwen_moe, qwen_moe, qwen_sliding


def _qwen2(raw: dict[str, Any], source: str, layers: int) -> dict[str, Any]:
    return {"qkv_bias": True, **qwen_sliding(raw, layers)}


def _qwen3(raw: dict[str, Any], source: str, layers: int) -> dict[str, Any]:
    return {"qk_norm": "head", **qwen_sliding(raw, layers)}


def _qwen2_moe(raw: dict[str, Any], source: str, layers: int) -> dict[str, Any]:
    return {"qkv_bias": bool(raw.get("qkv_bias", True)), "moe": qwen_moe(raw, layers, source, shared=True),
            **qwen_sliding(raw, layers)}


def _qwen3_moe(raw: dict[str, Any], source: str, layers: int) -> dict[str, Any]:
    return {"qk_norm": "head", "moe": qwen_moe(raw, layers, source, shared=False), **qwen_sliding(raw, layers)}


def _gguf_qwen2(g: GGUFMeta, cfg: dict[str, Any]) -> dict[str, Any]:
    return {"use_sliding_window": False}


def _gguf_qwen2_moe(g: GGUFMeta, cfg: dict[str, Any]) -> dict[str, Any]:
    return {**gguf_qwen_moe(g, norm_topk_prob=False),
            "shared_expert_intermediate_size": int(gguf_need(g, "expert_shared_feed_forward_length"))}


def _gguf_qwen3_moe(g: GGUFMeta, cfg: dict[str, Any]) -> dict[str, Any]:
    return gguf_qwen_moe(g, norm_topk_prob=True)


QWEN2 = Family(
    "Qwen2ForCausalLM", ("qwen2",), "Qwen2, Qwen2.5",
    "q/k/v bias; sliding layers from `max_window_layers` when `use_sliding_window`",
    read=_qwen2, gguf="qwen2", read_gguf=_gguf_qwen2,
)
QWEN3 = Family(
    "Qwen3ForCausalLM", ("qwen3",), "Qwen3 dense", "RMSNorm of q and k per head, before RoPE",
    read=_qwen3, gguf="qwen3",
)
QWEN2_MOE = Family(
    "Qwen2MoeForCausalLM", ("qwen2_moe",), "Qwen1.5-MoE, Qwen2-MoE",
    "q/k/v bias; top k without renormalisation (`norm_topk_prob`); a shared expert every token runs, scaled by "
    "`sigmoid(shared_expert_gate(x))`; dense layers from `mlp_only_layers` / `decoder_sparse_step`",
    read=_qwen2_moe, gguf="qwen2moe", read_gguf=_gguf_qwen2_moe,
)
QWEN3_MOE = Family(
    "Qwen3MoeForCausalLM", ("qwen3_moe",), "Qwen3-30B-A3B, Qwen3-235B-A22B",
    "Qwen3's per-head q/k norms; top k with `norm_topk_prob`",
    read=_qwen3_moe, gguf="qwen3moe", read_gguf=_gguf_qwen3_moe,
)
QWEN3_VL = Family(
    "Qwen3VLForConditionalGeneration", ("qwen3_vl",), "Qwen3-VL 2B / 4B / 8B / 32B dense (images in)",
    "Qwen3's text model (`text_config`) with interleaved M-RoPE (`mrope_interleaved`) and a ViT with learned "
    "positions (resampled to each image), whose DeepStack mergers add rows from its `deepstack_visual_indexes` "
    "blocks to the image tokens after the first decoder layers",
    read=_qwen3, vision="qwen3_vl", tensor_parallel=False,
    renames=((r"^model\.language_model\.", "model."), (r"^(model\.)?visual\..*$", "")),
)
QWEN2_5_VL = Family(
    "Qwen2_5_VLForConditionalGeneration", ("qwen2_5_vl",), "Qwen2.5-VL 3B / 7B / 32B / 72B (images in)",
    "Qwen2's text model (`text_config`) with M-RoPE (`mrope_section`: the rotary pairs split over an image token's "
    "temporal, row and column positions; text counts up on all three) and a windowed ViT (2-D rotary, full "
    "attention at `fullatt_block_indexes`) whose patch merger joins each 2 x 2 patches into one image token",
    read=_qwen2, vision="qwen2_5_vl", tensor_parallel=False,
    renames=((r"^model\.language_model\.", "model."), (r"^(model\.)?visual\..*$", "")),
)
