"""Phi-3 / 3.5 mini: Llama's block from a checkpoint that stores q/k/v and gate/up fused (already our layout),
LongRoPE (and its old names `su` / `yarn`), a sliding window on every layer."""

from __future__ import annotations

from typing import Any

from .base import Family
from .reading import every_layer_slides


def _phi3(raw: dict[str, Any], source: str, layers: int) -> dict[str, Any]:
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    if params.get("rope_type", params.get("type")) in ("su", "yarn"):  # Phi-3's old names for longrope
        params["rope_type"] = "longrope"
    return {"rope": {**raw, "rope_parameters": params}, **every_layer_slides(raw, source, layers)}


PHI3 = Family(
    "Phi3ForCausalLM", ("phi3",), "Phi-3, Phi-3.5 mini",
    "fused `qkv_proj` and `gate_up_proj` in the checkpoint (already our fused layout: loaded as they are); LongRoPE "
    "(`longrope`, and Phi-3's old names `su` / `yarn`); a sliding window on every layer",
    read=_phi3, gguf="phi3", fused_checkpoint=True,
)
