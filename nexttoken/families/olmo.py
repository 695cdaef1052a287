"""OLMo 2: norms after the attention and MLP outputs (not before), q/k RMSNorm over the whole projection."""

from __future__ import annotations

from typing import Any

from .base import Family
from .reading import every_layer_slides


def _olmo2(raw: dict[str, Any], source: str, layers: int) -> dict[str, Any]:
    return {"qk_norm": "projection", "norm_after": True, **every_layer_slides(raw, source, layers)}


OLMO2 = Family(
    "Olmo2ForCausalLM", ("olmo2",), "OLMo 2",
    "norms after attention and MLP (not before); q/k RMSNorm over the whole projection",
    read=_olmo2, gguf="olmo2",
)
