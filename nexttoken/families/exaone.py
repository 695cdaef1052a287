"""EXAONE 4: norms after attention and MLP (OLMo 2's places), per-head q/k RMSNorm; with a `sliding_window`, the
`layer_types` sliding layers (by default three of every `sliding_window_pattern` = 4) attend the window with RoPE
and the full layers use no RoPE at all (NoPE); without one, every layer full with RoPE. transformers'
configuration_exaone4.py / modeling_exaone4.py; llama.cpp's `exaone4`."""

from __future__ import annotations

from typing import Any

from ..errors import ModelLoadError
from .base import NOPE, SLIDING, Family, GGUFMeta
from .reading import layer_kinds


def _exaone4(raw: dict[str, Any], source: str, layers: int) -> dict[str, Any]:
    window = raw.get("sliding_window")
    out = {"qk_norm": "head", "norm_after": True}
    if window is None:  # transformers: RoPE on every layer, none slides
        return out | layer_kinds(None, [False] * layers)
    types = raw.get("layer_types")
    if types is None:
        pattern = raw.get("sliding_window_pattern", 4)
        if isinstance(pattern, str):  # "LLLG": L a local (sliding) layer, G a global one, repeated
            types = ["sliding_attention" if pattern[i % len(pattern)] == "L" else "full_attention" for i in range(layers)]
        else:
            types = ["sliding_attention" if (i + 1) % int(pattern) else "full_attention" for i in range(layers)]
    if len(types) != layers:
        raise ModelLoadError(f"{source}: layer_types has {len(types)} entries for num_hidden_layers={layers}")
    return out | layer_kinds(int(window), [t == "sliding_attention" for t in types], SLIDING, NOPE)


def _gguf(g: GGUFMeta, cfg: dict[str, Any]) -> dict[str, Any]:
    return {}


EXAONE4 = Family(
    "Exaone4ForCausalLM", ("exaone4",), "EXAONE 4.0",
    "norms after attention and MLP; per-head q/k norms; with `sliding_window`: sliding layers with RoPE "
    "(`layer_types` / `sliding_window_pattern`), full layers without RoPE (NoPE)",
    read=_exaone4, gguf="exaone4", read_gguf=_gguf,
)
