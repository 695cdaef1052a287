"""Qwen2-VL / Qwen2.5-VL / Qwen3-VL image preprocessing, equal to transformers 5.24's slow (PIL backend)
`Qwen2VLImageProcessor` and the processors' placeholder expansion.

Each image is resized (bicubic, Pillow) to the nearest size whose sides are multiples of patch_size * merge_size
and whose area lies within [min_pixels, max_pixels] (`smart_resize`), rescaled to [0, 1] (in float64, then
float32), normalised, and cut into patches: one row per patch_size x patch_size patch, ordered merge block by merge
block (the merger later joins each merge_size x merge_size block into one token), each row holding the patch's
C x temporal_patch_size x P x P values (the still image repeated over the temporal patch).
`<|image_pad|>` in the prompt becomes grid_t * grid_h * grid_w / merge_size^2 of itself.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ImageError
from .prepared import Prepared
from .source import _to_rgb

# transformers' OPENAI_CLIP_MEAN / OPENAI_CLIP_STD, the processor's defaults
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' smart_resize: sides multiples of `factor`, area within [min_pixels, max_pixels], the aspect
    ratio kept as closely as that allows."""
    if max(height, width) / min(height, width) > 200:
        raise ImageError(f"image is {width}x{height}: Qwen-VL needs an aspect ratio under 200 (crop or pad it)")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class QwenVLImages:
    """One checkpoint's preprocessing (its preprocessor_config.json) and its image placeholder."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    rescale_factor: float = 1 / 255
    resample: int = 3  # PIL.Image.BICUBIC
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    image_token: str = "<|image_pad|>"

    @classmethod
    def from_config(cls, raw: dict[str, Any], image_token: str = "<|image_pad|>") -> "QwenVLImages":
        """From preprocessor_config.json's fields, as transformers' __init__ reads them: `size`'s
        shortest_edge / longest_edge, overridden by min_pixels / max_pixels where given."""
        size = raw.get("size") or {}
        min_pixels = raw.get("min_pixels") or size.get("shortest_edge") or cls.min_pixels
        max_pixels = raw.get("max_pixels") or size.get("longest_edge") or cls.max_pixels
        mean, std = raw.get("image_mean", CLIP_MEAN), raw.get("image_std", CLIP_STD)
        return cls(
            patch_size=int(raw.get("patch_size", cls.patch_size)),
            temporal_patch_size=int(raw.get("temporal_patch_size", cls.temporal_patch_size)),
            merge_size=int(raw.get("merge_size", cls.merge_size)),
            min_pixels=int(min_pixels), max_pixels=int(max_pixels),
            image_mean=tuple(float(v) for v in (mean if isinstance(mean, (list, tuple)) else [mean] * 3)),
            image_std=tuple(float(v) for v in (std if isinstance(std, (list, tuple)) else [std] * 3)),
            rescale_factor=float(raw.get("rescale_factor", cls.rescale_factor)),
            resample=int(raw.get("resample", cls.resample)),
            do_resize=bool(raw.get("do_resize", True)), do_rescale=bool(raw.get("do_rescale", True)),
            do_normalize=bool(raw.get("do_normalize", True)), image_token=image_token,
        )

    @classmethod
    def from_dir(cls, folder: str | Path) -> "QwenVLImages":
        """A checkpoint folder's preprocessor_config.json (the processor's defaults where there is none)."""
        file = Path(folder) / "preprocessor_config.json"
        raw = json.loads(file.read_text()) if file.is_file() else {}
        return cls.from_config(raw)

    def grid(self, height: int, width: int) -> tuple[int, int, int]:
        """(grid_t, grid_h, grid_w): the patches an image of this size becomes."""
        if self.do_resize:
            height, width = smart_resize(height, width, self.patch_size * self.merge_size, self.min_pixels,
                                         self.max_pixels)
        return 1, height // self.patch_size, width // self.patch_size

    def prepare(self, images: list[Any]) -> Prepared:
        """PIL images -> Prepared: pixel_values (patches, C * T * P * P) float32, every image's patches in order;
        extra["image_grid_thw"] (images, 3) int64; tokens: each image's placeholder count."""
        if not images:
            raise ImageError("no images to prepare")
        patches, grids = [], []
        for image in images:
            rows, grid = self._patches(image)
            patches.append(rows)
            grids.append(grid)
        merge = self.merge_size**2
        return Prepared(np.concatenate(patches, axis=0), [t * h * w // merge for t, h, w in grids],
                        {"image_grid_thw": np.array(grids, dtype=np.int64)})

    def expand(self, text: str, prepared: Prepared) -> str:
        """The prompt with its i-th `<|image_pad|>` repeated as many times as image i's tokens, as the processor
        does before tokenising."""
        pieces = text.split(self.image_token)
        if len(pieces) - 1 != len(prepared.tokens):
            raise ImageError(f"the prompt holds {len(pieces) - 1} {self.image_token} placeholders for "
                             f"{len(prepared.tokens)} images: give one image per placeholder")
        out = [pieces[0]]
        for count, piece in zip(prepared.tokens, pieces[1:]):
            out += [self.image_token * count, piece]
        return "".join(out)

    def _patches(self, image: Any) -> tuple[np.ndarray, tuple[int, int, int]]:
        """One image -> its (patches, C * T * P * P) rows and its (1, grid_h, grid_w)."""
        from PIL import Image

        image = image if image.mode == "RGB" else _to_rgb(image)
        _, h, w = self.grid(image.height, image.width)
        size = (w * self.patch_size, h * self.patch_size)
        if self.do_resize:  # Pillow resizes even to the same size, as transformers' np_resize does
            image = image.resize(size, resample=Image.Resampling(self.resample))
        pixels = np.asarray(image)  # (H, W, C) uint8
        if pixels.shape[:2] != (size[1], size[0]):
            raise ImageError(f"image is {image.width}x{image.height}; without resizing Qwen-VL needs sides that "
                             f"are multiples of {self.patch_size * self.merge_size}")
        values = pixels.transpose(2, 0, 1)  # (C, H, W)
        if self.do_rescale:  # transformers rescales in float64 and casts to float32 after
            values = (values.astype(np.float64) * self.rescale_factor).astype(np.float32)
        values = values.astype(np.float32)
        if self.do_normalize:
            mean = np.array(self.image_mean, dtype=np.float32)[:, None, None]
            std = np.array(self.image_std, dtype=np.float32)[:, None, None]
            values = (values - mean) / std
        return self._flatten(values, h, w), (1, h, w)

    def _flatten(self, values: np.ndarray, grid_h: int, grid_w: int) -> np.ndarray:
        """(C, H, W) -> (grid_h * grid_w, C * T * P * P): patches merge block by merge block, each patch's values
        channel-major with the image repeated over the temporal patch (transformers' patchify)."""
        c, p, m, t = values.shape[0], self.patch_size, self.merge_size, self.temporal_patch_size
        blocks = values.reshape(c, grid_h // m, m, p, grid_w // m, m, p)
        blocks = blocks.transpose(1, 4, 2, 5, 0, 3, 6)  # (gh, gw, mh, mw, C, ph, pw)
        blocks = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], t, p, p))
        return np.ascontiguousarray(blocks.reshape(grid_h * grid_w, c * t * p * p), dtype=np.float32)
