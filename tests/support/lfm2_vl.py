"""LFM2-VL test inputs and the recorded outputs of transformers' own processor on them.

transformers' Lfm2VlImageProcessor has only a torchvision backend, and torchvision is not a test dependency: its
outputs on IMAGES (tiny processor settings, SETTINGS) are recorded in tests/data/lfm2_vl_processor.npz by running
this module with torchvision importable (`python tests/support/lfm2_vl.py`), and the tests compare against them."""

from __future__ import annotations

from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parents[1] / "data" / "lfm2_vl_processor.npz"
# 4-pixel patches, 32-pixel tiles, 4..16 tokens per image: at most 64 patches a tile, grids of 2..10 tiles
SETTINGS = dict(encoder_patch_size=4, tile_size=32, max_image_tokens=16, min_image_tokens=4, downsample_factor=2)
TOKENS = ["<image>", "<|image_start|>", "<|image_end|>", "<|img_thumbnail|>"] + [
    f"<|img_row_{r}_col_{c}|>" for r in range(1, 11) for c in range(1, 11)]


def photo(h: int, w: int, mode: str = "RGB"):  # noqa: ANN201 - a PIL image
    """A photo-like picture (gradients and a disc), deterministic, in `mode` (RGB, L or RGBA)."""
    from PIL import Image

    y, x = np.mgrid[0:h, 0:w]
    rgb = np.stack([255 * x / max(w - 1, 1), 255 * y / max(h - 1, 1), 128 + 100 * np.sin((x + y) / 7)], axis=-1)
    rgb[(y - h / 2) ** 2 + (x - w / 3) ** 2 < (min(h, w) / 4) ** 2] = (250, 30, 60)
    image = Image.fromarray(rgb.clip(0, 255).astype(np.uint8))
    if mode == "RGBA":
        alpha = (255 * (x / max(w - 1, 1))).astype(np.uint8)
        image = Image.fromarray(np.dstack([np.asarray(image), alpha]))
    return image.convert("L") if mode == "L" else image


IMAGES = {"tiny": (1, 1, "RGB"), "one-tile": (40, 17, "RGB"), "photo": (240, 320, "RGB"), "tall": (333, 40, "RGB"),
          "huge": (1500, 2100, "RGB"), "grayscale": (100, 30, "L"), "rgba": (64, 65, "RGBA")}


def record() -> None:
    """Write transformers' pixel values, masks, spatial shapes and placeholder text for each of IMAGES."""
    from transformers.image_transforms import convert_to_rgb
    from transformers.models.lfm2_vl.image_processing_lfm2_vl import Lfm2VlImageProcessor
    from transformers.models.lfm2_vl.processing_lfm2_vl import Lfm2VlProcessor

    processor = Lfm2VlImageProcessor(**SETTINGS)
    text = Lfm2VlProcessor.__new__(Lfm2VlProcessor)  # its placeholder strings need no tokenizer
    text.image_processor = processor
    text.image_token, text.image_start_token = "<image>", "<|image_start|>"
    text.image_end_token, text.image_thumbnail_token = "<|image_end|>", "<|img_thumbnail|>"
    out = {}
    for name, (h, w, mode) in IMAGES.items():
        # its processor does not convert to RGB by default: transformers' convert_to_rgb first, as load_image does
        got = processor(images=[convert_to_rgb(photo(h, w, mode))], return_tensors="np", return_row_col_info=True)
        for key in ("pixel_values", "pixel_attention_mask", "spatial_shapes"):
            out[f"{name}/{key}"] = got[key]
        out[f"{name}/text"] = np.array(text.replace_image_token(got, 0, use_image_special_tokens=True))
    DATA.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(DATA, **out)


if __name__ == "__main__":
    record()
