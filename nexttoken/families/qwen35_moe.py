"""Qwen3.5-MoE (Qwen3.5-35B-A3B, 122B-A10B, 397B-A17B; transformers' qwen3_5_moe): Qwen3.5's layers
(families/qwen35.py: gated-DeltaNet layers before each gated attention layer, (1 + w) norms, partial RoPE) with a
sparse MLP on every layer: a softmax router's top k renormalised, and a shared expert scaled by
sigmoid(shared_expert_gate). The released checkpoints are Qwen3_5MoeForConditionalGeneration: the text model is read
from `text_config` and `model.language_model.*`, the MTP head left out, and their vision tower (Qwen3.5's,
model/vision/qwen3_vl.py's Qwen35VisionTower) loaded beside it."""

from __future__ import annotations

from typing import Any

from .base import Family, GGUFMeta
from .qwen35 import QWEN3_5, _gguf as _qwen35_gguf, _qwen35
from .reading import gguf_need, gguf_qwen_moe, qwen_moe


def _qwen35_moe(raw: dict[str, Any], source: str, layers: int) -> dict[str, Any]:
    out = _qwen35(raw, source, layers)
    out["moe"] = qwen_moe({**raw, "norm_topk_prob": True}, layers, source, shared=True)
    out["intermediate_size"] = int(raw.get("intermediate_size") or 0)  # no dense MLP: every layer is sparse
    return out


def _gguf(g: GGUFMeta, cfg: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's qwen35moe keys: Qwen3.5's (families/qwen35.py), the experts' count, top k and width, the shared
    expert's width (its router always renormalises the top k, as transformers' Qwen3.5-MoE)."""
    return {**_qwen35_gguf(g, cfg), **gguf_qwen_moe(g, norm_topk_prob=True),
            "shared_expert_intermediate_size": int(gguf_need(g, "expert_shared_feed_forward_length"))}


QWEN3_5_MOE = Family(
    "Qwen3_5MoeForCausalLM", ("qwen3_5_moe_text", "qwen3_5_moe"), "Qwen3.5-MoE (35B-A3B-397B-A17B), text (images in)",
    "Qwen3.5's gated-DeltaNet and gated attention layers; every MLP sparse: softmax top k renormalised, a shared "
    "expert gated by sigmoid(`shared_expert_gate`)",
    read=_qwen35_moe, tensor_parallel=False, gguf="qwen35moe", read_gguf=_gguf,
    gguf_norm_shift=True, gguf_aliases=QWEN3_5.gguf_aliases, gguf_tensor=QWEN3_5.gguf_tensor,
    text_of=("Qwen3_5MoeForConditionalGeneration",), renames=QWEN3_5.renames, state=QWEN3_5.state,
    vision=QWEN3_5.vision,  # the ConditionalGeneration's tower: Qwen3.5's (transformers' Qwen3_5MoeVisionModel)
)
