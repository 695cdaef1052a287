"""SmolLM3: Llama's block with no RoPE in some layers (NoPE: `no_rope_layers[i] == 0`, by default every
`no_rope_layer_interval`-th = fourth layer), and, with `use_sliding_window`, a window on the layers `layer_types`
marks sliding (transformers' default: the NoPE ones). transformers' configuration_smollm3.py /
modeling_smollm3.py.

llama.cpp writes it from its LlamaModel (q / k rows permuted) as architecture `smollm3` with no key for the NoPE
layers: its loader fixes the step at 4 (`hparams.n_no_rope_layer_step = 4`, `use_rope = (il + 1) % 4 != 0`), and
it has no sliding window for it.
"""

from __future__ import annotations

from typing import Any

from ..errors import ModelLoadError
from .base import Family, GGUFMeta, LayerKind


def _smollm3(raw: dict[str, Any], source: str, layers: int) -> dict[str, Any]:
    interval = int(raw.get("no_rope_layer_interval", 4))
    if interval < 1:
        raise ModelLoadError(f"{source}: no_rope_layer_interval must be >= 1, got {interval}")
    rope = raw.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
    window = raw.get("sliding_window")
    slides = bool(raw.get("use_sliding_window", False)) and window is not None
    types = raw.get("layer_types") or [
        "sliding_attention" if slides and not rope[i] else "full_attention" for i in range(layers)]
    if len(rope) != layers or len(types) != layers:
        raise ModelLoadError(f"{source}: no_rope_layers ({len(rope)}) and layer_types ({len(types)}) need one "
                             f"entry per layer (num_hidden_layers={layers})")
    kinds = tuple(LayerKind(window=slides and t == "sliding_attention", rope="global" if r else None)
                  for r, t in zip(rope, types))
    return {"layers": kinds, "sliding_window": int(window) if slides else None}


def _gguf(g: GGUFMeta, cfg: dict[str, Any]) -> dict[str, Any]:
    return {"no_rope_layer_interval": 4}  # llama.cpp's fixed step (no GGUF key)


SMOLLM3 = Family(
    "SmolLM3ForCausalLM", ("smollm3",), "SmolLM3",
    "no RoPE in the layers `no_rope_layers` marks (every `no_rope_layer_interval`-th, 4th by default); a sliding "
    "window on the `layer_types` sliding layers when `use_sliding_window`",
    read=_smollm3, gguf="smollm3", read_gguf=_gguf, gguf_permuted=True,
)
