"""Images in (issue 43): where an image comes from (`source.py`: paths, bytes, data: URLs, PIL images, arrays, read
with Pillow and checked against the limits), and each vision family's preprocessing (`<family>.py`), equal to
transformers' image processors, with Pillow and numpy only, handing the engine a `Prepared` (prepared.py). The
towers that encode them are model/vision/."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .prepared import Prepared, PromptImage
from .source import ImageLimits, content_hash, load_image


def processor_for(vision: str | None, folder: str | Path) -> Any:
    """The preprocessing of a checkpoint whose family declares the vision kind `vision` (None: a text model)."""
    if vision is None:
        return None
    if vision == "gemma3":
        from .gemma3 import Gemma3Images

        return Gemma3Images.from_dir(folder)
    raise NotImplementedError(f"no image preprocessing for vision kind {vision!r}")


__all__ = ["ImageLimits", "Prepared", "PromptImage", "content_hash", "load_image", "processor_for"]
