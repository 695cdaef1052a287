"""Gemma 4's image processor and its processor's placeholder expansion, as transformers 5.24's
`Gemma4ImageProcessorPil` and `Gemma4Processor` compute them, with Pillow and numpy.

Each image: resized (Pillow, on the uint8 pixels, bicubic by default) to the largest size that keeps its aspect
ratio, has both sides a multiple of pooling_kernel_size x patch_size and at most max_soft_tokens x
pooling_kernel_size^2 patches; rescaled in float64 then cast to float32 (no normalisation: the tower maps [0, 1] to
[-1, 1] itself); cut into patch_size^2 x 3 patches (row-major, each patch's pixels row-major, channels last); padded
with zero patches to the budget. Each patch's (x, y) grid position is kept, padding's as (-1, -1). An image takes
(patches / pooling_kernel_size^2) soft tokens. In the prompt each `<|image|>` becomes
`<|image>` + that many `<|image|>` + `<image|>` (the tokenizer's boi / image / eoi tokens)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ImageError, ModelLoadError
from .prepared import Prepared

TOKENS = {"boi_token": "<|image>", "image_token": "<|image|>", "eoi_token": "<image|>"}
SOFT_TOKENS = (70, 140, 280, 560, 1120)  # the budgets transformers accepts (max_soft_tokens)


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def target_size(height: int, width: int, patch: int, max_patches: int, kernel: int) -> tuple[int, int]:
    """(height, width) an image is resized to: transformers' get_aspect_ratio_preserving_size."""
    factor = math.sqrt(max_patches * patch**2 / (height * width))
    side = kernel * patch
    h, w = int(math.floor(factor * height / side)) * side, int(math.floor(factor * width / side)) * side
    if h == 0 and w == 0:
        raise ImageError(f"a {width}x{height} image cannot be resized for Gemma 4: send a larger one")
    longest = (max_patches // kernel**2) * side
    if h == 0:  # a very wide image: one row of kernels, as wide as the ratio allows
        h, w = side, min(int(math.floor(width / height)) * side, longest)
    elif w == 0:
        w, h = side, min(int(math.floor(height / width)) * side, longest)
    if h * w > max_patches * patch**2:
        raise ImageError(f"a {width}x{height} image would take more than {max_patches} patches: send a less "
                         "elongated one")
    return h, w


class Gemma4Images:
    """The preprocessing of one Gemma 4 checkpoint (its processor_config.json / preprocessor_config.json)."""

    def __init__(self, processor: dict[str, Any], tokens: dict[str, str] | None = None) -> None:
        self.patch = int(processor.get("patch_size", 16))
        self.max_soft_tokens = int(processor.get("max_soft_tokens", 280))
        self.kernel = int(processor.get("pooling_kernel_size", 3))
        if self.max_soft_tokens not in SOFT_TOKENS:
            raise ModelLoadError(f"Gemma 4: max_soft_tokens must be one of {SOFT_TOKENS}, got "
                                 f"{self.max_soft_tokens} (its processor config)")
        self.max_patches = self.max_soft_tokens * self.kernel**2
        self.resample = int(processor.get("resample", 3))  # PIL.Image.BICUBIC
        self.do_resize = processor.get("do_resize", True)
        self.do_rescale = processor.get("do_rescale", True)
        self.rescale_factor = float(processor.get("rescale_factor", 1 / 255))
        self.do_normalize = processor.get("do_normalize", False)
        self.mean = np.array(processor.get("image_mean", [0.0, 0.0, 0.0]), dtype=np.float32)
        self.std = np.array(processor.get("image_std", [1.0, 1.0, 1.0]), dtype=np.float32)
        t = TOKENS | (tokens or {})
        self.placeholder, self.boi, self.eoi = t["image_token"], t["boi_token"], t["eoi_token"]

    @classmethod
    def from_dir(cls, folder: str | Path) -> "Gemma4Images":
        folder = Path(folder)
        proc = _json(folder / "processor_config.json")
        image = _json(folder / "preprocessor_config.json") or proc.get("image_processor") or {}
        tok = _json(folder / "tokenizer_config.json")  # boi_token, ... at its top level or in extra_special_tokens
        extra = tok.get("extra_special_tokens") if isinstance(tok.get("extra_special_tokens"), dict) else {}
        return cls(image, {k: v for k, v in {**tok, **extra}.items() if k in TOKENS and isinstance(v, str)})

    def prepare(self, images: list[Any]) -> Prepared:
        """RGB PIL images -> Prepared: pixel_values (N, max_patches, patch^2 x 3) float32, extra
        image_position_ids (N, max_patches, 2) int64 ((x, y); padding (-1, -1))."""
        pixels, positions, tokens = [], [], []
        for image in images:
            patches, where = self._patches(image)
            tokens.append(patches.shape[0] // self.kernel**2)
            pad = self.max_patches - patches.shape[0]
            pixels.append(np.pad(patches, ((0, pad), (0, 0))))
            positions.append(np.pad(where, ((0, pad), (0, 0)), constant_values=-1))
        width = self.patch**2 * 3
        out = np.stack(pixels) if pixels else np.zeros((0, self.max_patches, width), dtype=np.float32)
        where = np.stack(positions) if positions else np.zeros((0, self.max_patches, 2), dtype=np.int64)
        return Prepared(out, tokens, {"image_position_ids": where})

    def _patches(self, image: Any) -> tuple[np.ndarray, np.ndarray]:
        """One image -> its patches (n, patch^2 x 3) float32 and their (x, y) positions (n, 2) int64."""
        from PIL import Image

        if image.mode != "RGB":
            image = image.convert("RGB")
        if self.do_resize:
            h, w = target_size(image.height, image.width, self.patch, self.max_patches, self.kernel)
            if (h, w) != (image.height, image.width):
                image = image.resize((w, h), resample=Image.Resampling(self.resample))
        x = np.asarray(image)  # (H, W, 3) uint8
        if self.do_rescale:
            x = (x.astype(np.float64) * self.rescale_factor).astype(np.float32)  # as transformers' rescale
        else:
            x = x.astype(np.float32)
        if self.do_normalize:
            x = (x - self.mean) / self.std
        p = self.patch
        rows, cols = x.shape[0] // p, x.shape[1] // p
        patches = x[: rows * p, : cols * p].reshape(rows, p, cols, p, 3).transpose(0, 2, 1, 3, 4)
        gx, gy = np.meshgrid(np.arange(cols), np.arange(rows), indexing="xy")
        where = np.stack([gx, gy], axis=-1).reshape(rows * cols, 2).astype(np.int64)
        return np.ascontiguousarray(patches.reshape(rows * cols, -1), dtype=np.float32), where

    def expand(self, text: str, prepared: Prepared) -> str:
        """The prompt with each image's `<|image|>` replaced by boi + its soft tokens + eoi (one per image)."""
        found = text.count(self.placeholder)
        if found != len(prepared):
            raise ImageError(f"the prompt marks {found} image(s) with {self.placeholder!r} but {len(prepared)} "
                             f"image(s) were given: put one {self.placeholder} where each image goes, in order "
                             "(a chat's image parts do this for you)")
        pieces = text.split(self.placeholder)
        out = [pieces[0]]
        for n, rest in zip(prepared.tokens, pieces[1:]):
            out += [self.boi + self.placeholder * n + self.eoi, rest]
        return "".join(out)
