"""Images in (issue 43): where an image comes from (`source.py`: paths, bytes, data: URLs, PIL images, arrays, read
with Pillow and checked against the limits), and each vision family's preprocessing (`<family>.py`), equal to
transformers' image processors, with Pillow and numpy only, handing the engine a `Prepared` (prepared.py). The
towers that encode them are model/vision/."""

from __future__ import annotations

import importlib
from types import MappingProxyType
from pathlib import Path
from typing import Any

from .inputs import ImageInputs, read_images
from .prepared import Prepared, PromptImage
from .source import ImageLimits, content_hash, load_image

# vision kind (families/base.py's Family.vision) -> "module:class" here, each class read by from_dir(folder)
PROCESSORS = MappingProxyType({
    "gemma3": "gemma3:Gemma3Images",
    "qwen2_5_vl": "qwen_vl:QwenVLImages",
    "qwen3_vl": "qwen_vl:QwenVLImages",
})


def processor_for(vision: str | None, folder: str | Path) -> Any:
    """The preprocessing of a checkpoint whose family declares the vision kind `vision` (None: a text model)."""
    if vision is None:
        return None
    if vision not in PROCESSORS:
        raise NotImplementedError(f"no image preprocessing for vision kind {vision!r}")
    module, name = PROCESSORS[vision].split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name).from_dir(folder)


__all__ = ["ImageInputs", "ImageLimits", "Prepared", "PromptImage", "content_hash", "load_image", "processor_for",
           "read_images"]
