"""Qwen3.5-MoE (Qwen3.5-35B-A3B, 122B-A10B, 397B-A17B; transformers' qwen3_5_moe): Qwen3.5's layers
(families/qwen35.py: gated-DeltaNet layers before each gated attention layer, (1 + w) norms, partial RoPE) with a
sparse MLP on every layer: a softmax router's top k renormalised, and a shared expert scaled by
sigmoid(shared_expert_gate). The released checkpoints are Qwen3_5MoeForConditionalGeneration: the text model is read
from `text_config` and `model.language_model.*`, the MTP head left out, and their vision tower (Qwen3.5's,
model/vision/qwen3_vl.py's Qwen35VisionTower) loaded beside it."""

from __future__ import annotations

from typing import Any

from .base import Family
from .qwen35 import QWEN3_5, _qwen35
from .reading import qwen_moe


def _qwen35_moe(raw: dict[str, Any], source: str, layers: int) -> dict[str, Any]:
    out = _qwen35(raw, source, layers)
    out["moe"] = qwen_moe({**raw, "norm_topk_prob": True}, layers, source, shared=True)
    out["intermediate_size"] = int(raw.get("intermediate_size") or 0)  # no dense MLP: every layer is sparse
    return out


QWEN3_5_MOE = Family(
    "Qwen3_5MoeForCausalLM", ("qwen3_5_moe_text", "qwen3_5_moe"), "Qwen3.5-MoE (35B-A3B-397B-A17B), text (images in)",
    "Qwen3.5's gated-DeltaNet and gated attention layers; every MLP sparse: softmax top k renormalised, a shared "
    "expert gated by sigmoid(`shared_expert_gate`)",
    read=_qwen35_moe, tensor_parallel=False, lora=False,
    text_of=("Qwen3_5MoeForConditionalGeneration",), renames=QWEN3_5.renames, state=QWEN3_5.state,
    vision=QWEN3_5.vision,  # the ConditionalGeneration's tower: Qwen3.5's (transformers' Qwen3_5MoeVisionModel)
)
