"""Idefics3's and SmolVLM's preprocessing, equal to transformers 5.24's PIL image processor
(`Idefics3ImageProcessorPil`, `SmolVLMImageProcessorPil`: the same code) and the processor's prompt expansion
(`Idefics3Processor.replace_image_token`, SmolVLM's `get_image_prompt_string`: the same strings).

An image is resized so its longest edge is `size["longest_edge"]`, then (image splitting) up to multiples of the
encoder's tile side S = `max_image_size["longest_edge"]`, cut into rows x cols tiles of S x S, and followed by the
whole image resized to S x S (the global image); without splitting it is the global image alone. Every resize is
Pillow's on the uint8 image (LANCZOS by default), as transformers' `image_transforms.resize` does. Each tile then
takes `image_seq_len` placeholder tokens in the prompt."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ImageError
from .prepared import Prepared
from .settings import processor_settings, read_json, resample_filter
from .source import load_image

MAX_IMAGE_SIZE = 4096  # transformers' cap on the resized image's longest edge
LANCZOS = 1  # PIL.Image.Resampling.LANCZOS, the processor's default filter
IMAGE = "<image>"  # the placeholder a prompt marks each image with, and each tile row's token
FAKE = "<fake_token_around_image>"
GLOBAL = "<global-img>"


@dataclass(frozen=True)
class Idefics3Processor:
    """Pixel values and placeholder text of Idefics3 / SmolVLM images (settings as the checkpoint writes them)."""

    image_token = IMAGE  # the token whose embeddings the tower's rows replace

    longest_edge: int | None = 4 * 364  # size["longest_edge"]: the first resize; None: no resize
    tile: int = 364  # max_image_size["longest_edge"]: the encoder's square input
    splitting: bool = True  # do_image_splitting
    image_seq_len: int = 169  # placeholder tokens per tile: (image_size / patch_size)^2 / scale_factor^2
    resample: Any = LANCZOS
    rescale: float | None = 1 / 255  # None: do_rescale off
    mean: tuple[float, ...] | None = (0.5, 0.5, 0.5)  # None: do_normalize off
    std: tuple[float, ...] = (0.5, 0.5, 0.5)

    @classmethod
    def from_dir(cls, folder: str | Path) -> "Idefics3Processor":
        """The processor a checkpoint folder declares (preprocessor_config.json / processor_config.json, and
        config.json for the tokens per tile where the processor does not say)."""
        image, processor = processor_settings(folder)
        return cls.from_settings(image, processor, read_json(Path(folder) / "config.json"), str(folder))

    @classmethod
    def from_settings(cls, image: dict[str, Any], processor: dict[str, Any], config: dict[str, Any],
                      source: str = "the image processor") -> "Idefics3Processor":
        """From the image processor's settings, the processor's, and config.json (an mmproj GGUF gives all three)."""
        size = image.get("size") or {"longest_edge": 4 * 364}
        if not image.get("do_resize", True):
            longest = None
        elif "longest_edge" in size:
            longest = int(size["longest_edge"])
        else:
            raise ImageError(f"{source}: size {size!r}: Idefics3's processor resizes by longest_edge")
        seq = processor.get("image_seq_len") or _image_seq_len(config)
        return cls(longest_edge=longest, tile=int((image.get("max_image_size") or {}).get("longest_edge", 364)),
                   splitting=bool(image.get("do_image_splitting", True)), image_seq_len=int(seq),
                   resample=resample_filter(image.get("resample"), LANCZOS),
                   rescale=float(image.get("rescale_factor", 1 / 255)) if image.get("do_rescale", True) else None,
                   mean=tuple(image.get("image_mean", (0.5, 0.5, 0.5))) if image.get("do_normalize", True) else None,
                   std=tuple(image.get("image_std", (0.5, 0.5, 0.5))))

    def prepare(self, images: list[Any]) -> Prepared:
        """PIL images -> Prepared: pixel_values (tiles of every image, 3, S, S) float32 in prompt order;
        tokens[i] = image i's placeholder count; extra: rows, cols, tiles per image, pixel_attention_mask."""
        frames, rows, cols = [], [], []
        for image in images:
            image_frames, r, c = self._split(self._resized(_rgb(image)))
            frames += image_frames
            rows.append(r)
            cols.append(c)
        pixels = np.stack([self._normalized(f) for f in frames])  # (tiles, 3, S, S)
        tiles = [r * c + 1 for r, c in zip(rows, cols)]
        return Prepared(pixel_values=pixels, tokens=[t * self.image_seq_len for t in tiles],
                        extra={"rows": rows, "cols": cols, "tiles": tiles,
                               "pixel_attention_mask": np.ones((len(frames), *pixels.shape[2:]), dtype=bool)})

    def expand(self, text: str, prepared: Prepared) -> str:
        """The prompt with its i-th `<image>` replaced by image i's tokens, as Idefics3Processor writes them."""
        parts = text.split(IMAGE)
        rows, cols = prepared.extra["rows"], prepared.extra["cols"]
        if len(parts) - 1 != len(rows):
            raise ImageError(f"the prompt has {len(parts) - 1} {IMAGE} placeholders for {len(rows)} images; "
                             f"put one {IMAGE} where each image goes")
        out = [parts[0]]
        for r, c, rest in zip(rows, cols, parts[1:]):
            out += [self.image_text(r, c), rest]
        return "".join(out)

    def image_text(self, rows: int, cols: int) -> str:
        """One image's placeholder text: each tile's `<row_r_col_c>` and tokens, then the global image's."""
        tokens = IMAGE * self.image_seq_len
        whole = f"{FAKE}{GLOBAL}{tokens}{FAKE}"
        if rows == 0 and cols == 0:
            return whole
        grid = "".join("".join(f"{FAKE}<row_{r + 1}_col_{c + 1}>{tokens}" for c in range(cols)) + "\n"
                       for r in range(rows))
        return f"{grid}\n{whole}"

    def _resized(self, image: Any) -> Any:
        """The first resize: the longest edge to `longest_edge` (up or down), the other edge kept even."""
        if self.longest_edge is None:
            return image
        w, h = image.size
        h, w = _rescale_to_max_len(h, w, self.longest_edge)
        h, w = _scale_below(h, w, MAX_IMAGE_SIZE)
        return image.resize((w, h), resample=self.resample)

    def _split(self, image: Any) -> tuple[list[Any], int, int]:
        """-> (tiles row-major then the global image, rows, cols); (global image, 0, 0) when it fits one tile."""
        s = self.tile
        if not self.splitting:
            return [image.resize((s, s), resample=self.resample)], 0, 0
        w, h = image.size
        aspect = w / h
        if w >= h:  # the long side up to a multiple of S, the short side from it, then up to a multiple too
            w = math.ceil(w / s) * s
            h = math.ceil(int(w / aspect) / s) * s
        else:
            h = math.ceil(h / s) * s
            w = math.ceil(int(h * aspect) / s) * s
        image = image.resize((w, h), resample=self.resample)
        if h <= s and w <= s:
            return [image], 0, 0
        rows, cols = (h - s) // s + 1, (w - s) // s + 1
        tiles = [image.crop((c * s, r * s, (c + 1) * s, (r + 1) * s)) for r in range(rows) for c in range(cols)]
        return tiles + [image.resize((s, s), resample=self.resample)], rows, cols

    def _normalized(self, image: Any) -> np.ndarray:
        """uint8 (H, W, 3) -> float32 (3, H, W): rescaled in float64 then cast, normalised in float32 (as
        transformers' rescale and normalize)."""
        x = np.asarray(image).transpose(2, 0, 1)  # (3, H, W)
        if self.rescale is not None:
            x = (x.astype(np.float64) * self.rescale).astype(np.float32)
        else:
            x = x.astype(np.float32)
        if self.mean is not None:
            mean = np.asarray(self.mean, dtype=np.float32)[:, None, None]
            std = np.asarray(self.std, dtype=np.float32)[:, None, None]
            x = (x - mean) / std
        return x


def _rgb(image: Any) -> Any:
    """An RGB PIL image (load_image converts any other mode as transformers' convert_to_rgb does)."""
    return image if getattr(image, "mode", None) == "RGB" else load_image(image)


def _rescale_to_max_len(h: int, w: int, max_len: int) -> tuple[int, int]:
    """transformers' _resize_output_size_rescale_to_max_len: the longest edge to max_len, the other even, >= 1."""
    aspect = w / h
    if w >= h:
        w = max_len
        h = int(w / aspect)
        h += h % 2
    else:
        h = max_len
        w = int(h * aspect)
        w += w % 2
    return max(h, 1), max(w, 1)


def _scale_below(h: int, w: int, max_len: int) -> tuple[int, int]:
    """transformers' _resize_output_size_scale_below_upper_bound: the longest edge down to max_len if past it."""
    aspect = w / h
    if w >= h and w > max_len:
        w, h = max_len, int(max_len / aspect)
    elif h > w and h > max_len:
        h, w = max_len, int(max_len * aspect)
    return max(h, 1), max(w, 1)


def _image_seq_len(config: dict[str, Any]) -> int:
    """Placeholder tokens per tile from config.json: the vision tower's patches per side squared, over the pixel
    shuffle's scale_factor squared (Idefics3Model.image_seq_len)."""
    vision = config.get("vision_config") or {}
    side = int(vision.get("image_size", 224)) // int(vision.get("patch_size", 32))
    return int(side ** 2 / int(config.get("scale_factor", 2)) ** 2)
