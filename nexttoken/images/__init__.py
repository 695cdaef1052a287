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
    "gemma4": "gemma4:Gemma4Images",
    "idefics3": "idefics3:Idefics3Processor",
    "lfm2_vl": "lfm2_vl:Lfm2VlProcessor",
    "qwen2_5_vl": "qwen_vl:QwenVLImages",
    "qwen3_5": "qwen_vl:QwenVLImages",
    "qwen3_vl": "qwen_vl:QwenVLImages",
})


def processor_for(vision: str | None, folder: str | Path) -> Any:
    """The preprocessing of a checkpoint whose family declares the vision kind `vision` (None: a text model)."""
    if vision is None:
        return None
    return _processor_class(vision).from_dir(folder)


def processor_from_settings(vision: str, image: dict[str, Any], processor: dict[str, Any],
                            config: dict[str, Any], source: str) -> Any:
    """The preprocessing of vision kind `vision` from its settings (an mmproj GGUF's, read back as
    preprocessor_config.json's, processor_config.json's and config.json's keys)."""
    return _processor_class(vision).from_settings(image, processor, config, source)


def _processor_class(vision: str) -> Any:
    if vision not in PROCESSORS:
        raise NotImplementedError(f"no image preprocessing for vision kind {vision!r}")
    module, name = PROCESSORS[vision].split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


__all__ = ["ImageInputs", "ImageLimits", "Prepared", "PromptImage", "content_hash", "load_image", "processor_for",
           "processor_from_settings", "read_images"]
