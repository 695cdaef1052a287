"""OLMo 3: OLMo 2's block (norms after attention and MLP, q/k RMSNorm over the whole projection) with sliding
layers: `layer_types`, by default three sliding layers then a full one. RoPE parameters keyed by layer type
(transformers 5): where the two differ, the sliding layers rotate with their own (the `local` RoPE); YaRN (the long
context checkpoints' full layers) is refused by the RoPE reader. transformers' configuration_olmo3.py /
modeling_olmo3.py. llama.cpp's converter writes it as an `olmo2` file with a sliding window and its per-layer
pattern (families/olmo.py reads that back as OLMo 3; one RoPE base for both kinds)."""

from __future__ import annotations

from typing import Any

from ..errors import ModelLoadError
from .base import LOCAL_SLIDING, SLIDING, Family
from .reading import layer_kinds

_THETA = 500_000.0  # transformers' Olmo3Config.default_theta


def _olmo3(raw: dict[str, Any], source: str, layers: int) -> dict[str, Any]:
    types = raw.get("layer_types") or ["sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(layers)]
    if len(types) != layers:
        raise ModelLoadError(f"{source}: layer_types has {len(types)} entries for num_hidden_layers={layers}")
    params = raw.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full, local = dict(params.get("full_attention") or {}), dict(params.get("sliding_attention") or {})
    else:  # one set (older configs: rope_theta + rope_scaling, the scaling on the full layers)
        full = {**(raw.get("rope_scaling") or {}), **params}
        local = {"rope_theta": full.get("rope_theta", raw.get("rope_theta", _THETA))}
    for p in (full, local):
        p.setdefault("rope_theta", raw.get("rope_theta", _THETA))
    window = raw.get("sliding_window")
    slides = [window is not None and t == "sliding_attention" for t in types]
    own = any(slides) and {"rope_type": "default", **local} != {"rope_type": "default", **full}
    out = {"qk_norm": "projection", "norm_after": True, "rope": {"rope_parameters": full},
           **layer_kinds(None if window is None else int(window), slides, LOCAL_SLIDING if own else SLIDING)}
    return out | ({"rope_local": {"rope_parameters": local}} if own else {})


OLMO3 = Family(
    "Olmo3ForCausalLM", ("olmo3",), "OLMo 3",
    "OLMo 2's block plus sliding layers (`layer_types`; by default three sliding, then one full); RoPE parameters "
    "per layer type (the sliding layers' own base where it differs)",
    read=_olmo3,
)
