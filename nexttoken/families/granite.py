"""Granite 3: Llama's block with four multipliers (embeddings, attention scale, residual branches, logits).
llama.cpp writes it from LlamaModel: q / k rows permuted, the multipliers as granite.* scales."""

from __future__ import annotations

from typing import Any

from .base import Family, GGUFMeta
from .reading import every_layer_slides


def _granite(raw: dict[str, Any], source: str, layers: int) -> dict[str, Any]:
    return {"embedding_multiplier": float(raw.get("embedding_multiplier", 1.0)),
            "attention_multiplier": float(raw["attention_multiplier"]),
            "residual_multiplier": float(raw.get("residual_multiplier", 1.0)),
            "logits_scaling": float(raw.get("logits_scaling", 1.0)), **every_layer_slides(raw, source, layers)}


def _gguf(g: GGUFMeta, cfg: dict[str, Any]) -> dict[str, Any]:
    return {"embedding_multiplier": float(g.get("embedding_scale", 1.0)),
            "residual_multiplier": float(g.get("residual_scale", 1.0)),
            "attention_multiplier": float(g.get("attention.scale", cfg["head_dim"] ** -0.5)),
            "logits_scaling": float(g.get("logit_scale", 1.0))}


GRANITE = Family(
    "GraniteForCausalLM", ("granite",), "Granite 3", "embedding, attention, residual and logits multipliers",
    read=_granite, gguf="granite", read_gguf=_gguf, gguf_permuted=True,
)
