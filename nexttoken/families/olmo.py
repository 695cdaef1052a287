"""OLMo 2: norms after the attention and MLP outputs (not before), q/k RMSNorm over the whole projection. llama.cpp's
`olmo2` GGUF files hold OLMo 3 too (a sliding window pattern marks them)."""

from __future__ import annotations

from typing import Any

from .base import Family, GGUFMeta
from .reading import every_layer_slides


def _olmo2(raw: dict[str, Any], source: str, layers: int) -> dict[str, Any]:
    return {"qk_norm": "projection", "norm_after": True, **every_layer_slides(raw, source, layers)}


def _gguf(g: GGUFMeta, cfg: dict[str, Any]) -> dict[str, Any]:
    """An `olmo2` file with a sliding window pattern is OLMo 3 (llama.cpp's converter writes both as olmo2)."""
    pattern = g.get("attention.sliding_window_pattern")
    if g.get("attention.sliding_window") is None or pattern is None:
        return {}
    return {"architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3",
            "layer_types": ["sliding_attention" if s else "full_attention" for s in pattern]}


OLMO2 = Family(
    "Olmo2ForCausalLM", ("olmo2",), "OLMo 2",
    "norms after attention and MLP (not before); q/k RMSNorm over the whole projection",
    read=_olmo2, gguf="olmo2", read_gguf=_gguf,
)
