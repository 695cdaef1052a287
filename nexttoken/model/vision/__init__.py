"""Vision towers and projectors (issue 43): a module per vision kind (families/base.py's `Family.vision`), each an
nn.Module whose `encode(prepared)` turns one request's preprocessed images (images/prepared.py's Prepared: read
here by its fields, the images layer sits beside this one) into (N, text hidden) rows, one per placeholder token
in prompt order. weights/loader.py builds the tower of a checkpoint whose family declares one, from its config.json
and its tensors, and hangs it on the decoder as `model.vision`.

What every tower offers the engine: `image_token_id` (the placeholder id the rows replace), `bidirectional`
(whether one image's tokens attend each other both ways during prefill: Gemma 3's token_type_ids), and
`prefixes` (the checkpoint's tensor names it reads)."""

from __future__ import annotations

import importlib
from types import MappingProxyType
from typing import Any

import torch

# vision kind -> "module:class" under model/vision/ (each module's class: from_checkpoint(raw config, tensors))
TOWERS = MappingProxyType({
    "gemma3": "gemma3:Gemma3Vision",
    "gemma4": "gemma4:Gemma4Vision",
    "idefics3": "idefics3:Idefics3Vision",
    "lfm2_vl": "lfm2_vl:Lfm2VlVision",
    "qwen2_5_vl": "qwen_vl:QwenVisionTower",
    "qwen3_5": "qwen3_vl:Qwen35VisionTower",
    "qwen3_vl": "qwen3_vl:Qwen3VisionTower",
})


def tower_class(kind: str) -> Any:
    if kind not in TOWERS:
        raise NotImplementedError(f"no vision tower for vision kind {kind!r}")
    module, name = TOWERS[kind].split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def build(kind: str, raw: dict[str, Any], tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The tower of vision kind `kind` from the checkpoint's raw config.json and its tensors (the names
    `tower_class(kind).prefixes` select, as stored)."""
    return tower_class(kind).from_checkpoint(raw, tensors)
