"""The readers several families share: sliding-window layouts, soft-caps, mixture-of-experts fields and the GGUF
keys of the MoE files. Each returns ModelConfig field values (config.py validates and builds the dataclasses)."""

from __future__ import annotations

import math
from typing import Any, Sequence

from ..errors import ModelLoadError
from .base import FULL, SLIDING, GGUFMeta, LayerKind


def layer_kinds(window: int | None, sliding: Sequence[bool], slide: LayerKind = SLIDING,
                full: LayerKind = FULL) -> dict[str, Any]:
    """ModelConfig's sliding_window and per-layer kinds: `slide` where sliding[i], `full` elsewhere."""
    return {"sliding_window": window, "layers": tuple(slide if s else full for s in sliding)}


def every_layer_slides(raw: dict[str, Any], source: str, layers: int) -> dict[str, Any]:
    """Mistral's and Phi-3's window: every layer slides when config.json sets `sliding_window`."""
    window = raw.get("sliding_window")
    return layer_kinds(None if window is None else int(window), [window is not None] * layers)


def qwen_sliding(raw: dict[str, Any], layers: int) -> dict[str, Any]:
    """Qwen's sliding layers: none unless `use_sliding_window`; then `layer_types`, or those from
    `max_window_layers` on."""
    window = raw.get("sliding_window")
    if window is None or not raw.get("use_sliding_window", False):
        return layer_kinds(None, [False] * layers)
    types = raw.get("layer_types")
    if types is None:
        first = int(raw.get("max_window_layers", layers))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    return layer_kinds(int(window), [t == "sliding_attention" for t in types])


def cap(raw: dict[str, Any], key: str, source: str) -> float | None:
    """A soft-cap (Gemma): a positive number, or None."""
    value = raw.get(key)
    if value is None:
        return None
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ModelLoadError(f"{source}: {key} must be a positive number or null, got {value!r}")
    return float(value)


def qwen_moe(raw: dict[str, Any], layers: int, source: str, shared: bool) -> dict[str, Any]:
    """Qwen2-MoE / Qwen3-MoE: sparse layers every `decoder_sparse_step` but `mlp_only_layers`; Qwen2-MoE's shared
    expert. MoeConfig's fields (config.py checks top_k against the experts)."""
    step = int(raw.get("decoder_sparse_step", 1))
    if step < 1:
        raise ModelLoadError(f"{source}: decoder_sparse_step must be >= 1, got {step}")
    dense = set(raw.get("mlp_only_layers") or [])
    width = int(raw.get("shared_expert_intermediate_size") or 0) if shared else 0
    if shared and width <= 0:
        raise ModelLoadError(f"{source}: Qwen2-MoE needs shared_expert_intermediate_size > 0, got {width}")
    return dict(num_experts=raw.get("num_experts") or raw.get("num_local_experts"),
                top_k=raw.get("num_experts_per_tok"), intermediate_size=int(raw["moe_intermediate_size"]),
                norm_topk_prob=bool(raw.get("norm_topk_prob", False)), router_weights_float32=False,
                shared_intermediate_size=width,
                sparse_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(layers)))


def gguf_need(g: GGUFMeta, key: str) -> Any:
    value = g.get(key)
    if value is None:
        raise ModelLoadError(f"{g.path}: the GGUF metadata has no {key} for its architecture; the file is incomplete")
    return value


def gguf_qwen_moe(g: GGUFMeta, norm_topk_prob: bool) -> dict[str, Any]:
    """llama.cpp's qwen2moe / qwen3moe keys; it renormalises the chosen weights for Qwen3-MoE, never for Qwen2-MoE
    (as the checkpoints do)."""
    return {"num_experts": int(gguf_need(g, "expert_count")), "num_experts_per_tok": int(gguf_need(g, "expert_used_count")),
            "moe_intermediate_size": int(gguf_need(g, "expert_feed_forward_length")), "norm_topk_prob": norm_topk_prob}
