"""A checkpoint's preprocessing settings, where transformers writes them: `preprocessor_config.json` (the Hub's
checkpoints) or the `image_processor` entry of `processor_config.json` (transformers 5's save_pretrained), and the
processor's own keys (`image_seq_len`, ...) in `processor_config.json`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import ImageError


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a file; {} when the file is absent."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ImageError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise ImageError(f"{path} must hold a JSON object, not {type(data).__name__}")
    return data


def processor_settings(folder: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """folder -> (the image processor's settings, the processor's settings)."""
    folder = Path(folder)
    processor = read_json(folder / "processor_config.json")
    image = read_json(folder / "preprocessor_config.json") or processor.get("image_processor") or {}
    if not isinstance(image, dict):
        raise ImageError(f"{folder}: processor_config.json's image_processor must be a JSON object")
    return image, processor


def resample_filter(value: Any, default: int) -> Any:
    """A config's `resample` (PIL's integer code, as transformers writes it) -> PIL's filter."""
    from PIL import Image

    try:
        return Image.Resampling(default if value is None else int(value))
    except (TypeError, ValueError):
        raise ImageError(f"resample {value!r} is not one of PIL's filters "
                         f"({', '.join(f'{r.value} ({r.name})' for r in Image.Resampling)})") from None
