"""LFM2-VL's preprocessing, equal to transformers 5.24's `Lfm2VlImageProcessor` (it has only the torchvision
backend) and `Lfm2VlProcessor`'s prompt expansion.

An image small enough for one tile is "smart-resized": both sides to multiples of encoder_patch_size x
downsample_factor, its area within [min_image_tokens, max_image_tokens] tokens' worth. A larger one is resized to
the grid of tile_size tiles whose aspect ratio is closest to its own (min_tiles..max_tiles tiles), cut into them,
and followed by its smart-resized thumbnail. Each tile is normalised and cut into patches of encoder_patch_size,
padded to the processor's maximum patch count (pixel_attention_mask marks the real ones; spatial_shapes gives each
tile's patch grid).

The resizes are torchvision's: `F.interpolate(mode="bilinear", align_corners=False, antialias=True)` on the uint8
pixels (torch's native uint8 kernel), so this module computes them with torch, not Pillow: Pillow's bilinear
filter rounds differently."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ImageError
from .prepared import Prepared
from .settings import processor_settings
from .source import load_image

BILINEAR = 2  # PIL.Image.Resampling.BILINEAR: the only filter the processor uses
IMAGE = "<image>"
START, END, THUMBNAIL = "<|image_start|>", "<|image_end|>", "<|img_thumbnail|>"


@dataclass(frozen=True)
class Lfm2VlProcessor:
    """Pixel values and placeholder text of LFM2-VL images (settings as the checkpoint writes them)."""

    image_token = IMAGE  # the token whose embeddings the tower's rows replace

    downsample_factor: int = 2
    splitting: bool = True  # do_image_splitting
    min_tiles: int = 2
    max_tiles: int = 10
    use_thumbnail: bool = True
    min_image_tokens: int = 64
    max_image_tokens: int = 256
    patch: int = 16  # encoder_patch_size
    tile_size: int = 512
    max_pixels_tolerance: float = 2.0
    rescale: float = 1 / 255
    mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    std: tuple[float, ...] = (0.5, 0.5, 0.5)
    special_tokens: bool = True  # use_image_special_tokens: <|image_start|>, each tile's <|img_row_r_col_c|>, ...

    @classmethod
    def from_dir(cls, folder: str | Path) -> "Lfm2VlProcessor":
        image, processor = processor_settings(folder)
        return cls.from_settings(image, processor, {}, str(folder))

    @classmethod
    def from_settings(cls, image: dict[str, Any], processor: dict[str, Any], config: dict[str, Any],
                      source: str = "the image processor") -> "Lfm2VlProcessor":
        if int(image.get("resample", BILINEAR)) != BILINEAR:
            raise ImageError(f"{source}: resample {image['resample']!r}: LFM2-VL's processor resizes bilinearly (2)")
        if not (image.get("do_rescale", True) and image.get("do_normalize", True) and image.get("do_pad", True)):
            raise ImageError(f"{source}: LFM2-VL's processor is read with rescaling, normalisation and padding on")
        get = lambda key, default: image.get(key, default)  # noqa: E731
        return cls(downsample_factor=int(get("downsample_factor", 2)), splitting=bool(get("do_image_splitting", True)),
                   min_tiles=int(get("min_tiles", 2)), max_tiles=int(get("max_tiles", 10)),
                   use_thumbnail=bool(get("use_thumbnail", True)), min_image_tokens=int(get("min_image_tokens", 64)),
                   max_image_tokens=int(get("max_image_tokens", 256)), patch=int(get("encoder_patch_size", 16)),
                   tile_size=int(get("tile_size", 512)), max_pixels_tolerance=float(get("max_pixels_tolerance", 2.0)),
                   rescale=float(get("rescale_factor", 1 / 255)), mean=tuple(get("image_mean", (0.5,) * 3)),
                   std=tuple(get("image_std", (0.5,) * 3)),
                   special_tokens=bool(processor.get("use_image_special_tokens", True)))

    @property
    def max_patches(self) -> int:
        """Patches every tile is padded to: a thumbnail's most, or a tile's."""
        tile = (self.tile_size // self.patch) ** 2 if self.splitting else 0
        return max(self.max_image_tokens * self.downsample_factor ** 2, tile)

    def prepare(self, images: list[Any]) -> Prepared:
        """PIL images -> Prepared: pixel_values (tiles, max_patches, 3 p p) float32; extra: pixel_attention_mask
        (tiles, max_patches) bool, spatial_shapes (tiles, 2), rows, cols, sizes (each image's smart-resized size)."""
        tiles, rows, cols, sizes = [], [], [], []
        for image in images:
            image_tiles, r, c, size = self._tiles(_rgb(image))
            tiles += image_tiles
            rows.append(r)
            cols.append(c)
            sizes.append(size)
        patched = [self._patches(t) for t in tiles]
        if max(len(p) for p in patched) > self.max_patches:  # transformers' processor fails on these, in torch.stack
            raise ImageError(f"an image of {images[0].size[0]}x{images[0].size[1]} pixels resizes to more than the "
                             f"processor's {self.max_patches} patches: its aspect ratio is too extreme for LFM2-VL "
                             "(crop or pad it nearer to square)")
        pixels = np.zeros((len(tiles), self.max_patches, 3 * self.patch ** 2), dtype=np.float32)
        mask = np.zeros((len(tiles), self.max_patches), dtype=bool)
        for i, p in enumerate(patched):
            pixels[i, :len(p)], mask[i, :len(p)] = p, True
        shapes = np.array([[t.shape[-2] // self.patch, t.shape[-1] // self.patch] for t in tiles], dtype=np.int64)
        tokens = [self._token_count(r, c, s) for r, c, s in zip(rows, cols, sizes)]
        return Prepared(pixels, tokens, {"pixel_attention_mask": mask, "spatial_shapes": shapes.reshape(-1, 2),
                                         "rows": rows, "cols": cols, "sizes": sizes})

    def expand(self, text: str, prepared: Prepared) -> str:
        """The prompt with its i-th `<image>` replaced by image i's tokens, as Lfm2VlProcessor writes them."""
        parts = text.split(IMAGE)
        rows, cols, sizes = prepared.extra["rows"], prepared.extra["cols"], prepared.extra["sizes"]
        if len(parts) - 1 != len(rows):
            raise ImageError(f"the prompt has {len(parts) - 1} {IMAGE} placeholders for {len(rows)} images; "
                             f"put one {IMAGE} where each image goes")
        out = [parts[0]]
        for r, c, size, rest in zip(rows, cols, sizes, parts[1:]):
            out += [self.image_text(r, c, size), rest]
        return "".join(out)

    def image_text(self, rows: int, cols: int, size: tuple[int, int]) -> str:
        """Lfm2VlProcessor._build_image_tokens: the tiles' tokens (each after its row/column tag), then the
        thumbnail's; a single tile's tokens alone; all between <|image_start|> and <|image_end|>."""
        whole = IMAGE * self._tokens_for(size)
        special = self.special_tokens
        parts = [START] if special else []
        if rows > 1 or cols > 1:
            tile = IMAGE * math.ceil(self.tile_size // self.patch / self.downsample_factor) ** 2
            for r in range(rows):
                for c in range(cols):
                    parts += ([f"<|img_row_{r + 1}_col_{c + 1}|>"] if special else []) + [tile]
            if self.use_thumbnail:
                parts += ([THUMBNAIL] if special else []) + [whole]
        else:
            parts.append(whole)
        return "".join(parts + ([END] if special else []))

    def _token_count(self, rows: int, cols: int, size: tuple[int, int]) -> int:
        if rows > 1 or cols > 1:
            tile = math.ceil(self.tile_size // self.patch / self.downsample_factor) ** 2
            return rows * cols * tile + (self._tokens_for(size) if self.use_thumbnail else 0)
        return self._tokens_for(size)

    def _tokens_for(self, size: tuple[int, int]) -> int:
        h, w = size
        f = self.downsample_factor
        return math.ceil((h // self.patch) / f) * math.ceil((w // self.patch) / f)

    def _tiles(self, image: Any) -> tuple[list[Any], int, int, tuple[int, int]]:
        """-> (uint8 (1, 3, H, W) tiles, rows, cols, the smart-resized size), as resize_and_split makes them."""
        import torch

        x = torch.from_numpy(np.array(image)).permute(2, 0, 1).contiguous()[None]  # (1, 3, H, W) uint8
        height, width = x.shape[-2:]
        new_h, new_w = self._smart_size(height, width)
        split = self.splitting and not self.min_tiles == self.max_tiles == 1
        if not (split and self._too_large(height, width)):
            return [_resize(x, new_h, new_w)], 1, 1, (new_h, new_w)
        grid_w, grid_h = self._grid(height, width)
        big = _resize(x, self.tile_size * grid_h, self.tile_size * grid_w)
        s = self.tile_size
        tiles = [big[..., r * s:(r + 1) * s, c * s:(c + 1) * s] for r in range(grid_h) for c in range(grid_w)]
        if self.use_thumbnail and grid_w * grid_h != 1:
            tiles.append(_resize(x, new_h, new_w))
        return tiles, grid_h, grid_w, (new_h, new_w)

    def _patches(self, tile: Any) -> np.ndarray:
        """uint8 (1, 3, H, W) -> float32 (H/p * W/p, p * p * 3): normalised as transformers fuses rescale and
        normalise ((x - mean / rescale) / (std / rescale) in float32), patches row-major, each (row, column,
        channel)."""
        import torch

        mean = torch.tensor(self.mean) * (1.0 / self.rescale)  # (3,) float32
        std = torch.tensor(self.std) * (1.0 / self.rescale)
        x = (tile.to(torch.float32) - mean[:, None, None]) / std[:, None, None]  # (1, 3, H, W)
        _, c, h, w = x.shape
        p = self.patch
        x = x.reshape(c, h // p, p, w // p, p).permute(1, 3, 2, 4, 0).reshape((h // p) * (w // p), p * p * c)
        return x.numpy()

    def _smart_size(self, height: int, width: int) -> tuple[int, int]:
        """Lfm2VlImageProcessor.smart_resize -> (height, width)."""
        factor = self.patch * self.downsample_factor
        lo = self.min_image_tokens * self.patch ** 2 * self.downsample_factor ** 2
        hi = self.max_image_tokens * self.patch ** 2 * self.downsample_factor ** 2
        h = max(factor, round(height / factor) * factor)
        w = max(factor, round(width / factor) * factor)
        if h * w > hi:
            beta = math.sqrt((height * width) / hi)
            h = max(factor, math.floor(height / beta / factor) * factor)
            w = max(factor, math.floor(width / beta / factor) * factor)
        elif h * w < lo:
            beta = math.sqrt(lo / (height * width))
            h = math.ceil(height * beta / factor) * factor
            w = math.ceil(width * beta / factor) * factor
        return h, w

    def _too_large(self, height: int, width: int) -> bool:
        factor = self.patch * self.downsample_factor
        h = max(self.patch, round(height / factor) * factor)
        w = max(self.patch, round(width / factor) * factor)
        return h * w > self.max_image_tokens * self.patch ** 2 * self.downsample_factor ** 2 * self.max_pixels_tolerance

    def _grid(self, height: int, width: int) -> tuple[int, int]:
        """The (columns, rows) of tiles whose aspect ratio is closest to the image's (find_closest_aspect_ratio:
        a tie goes to the larger grid when the image covers more than half its area)."""
        ratios = sorted({(w, h) for n in range(self.min_tiles, self.max_tiles + 1) for w in range(1, n + 1)
                         for h in range(1, n + 1) if self.min_tiles <= w * h <= self.max_tiles},
                        key=lambda r: r[0] * r[1])
        aspect, best, best_diff = width / height, (1, 1), float("inf")
        for ratio in ratios:
            diff = abs(aspect - ratio[0] / ratio[1])
            if diff < best_diff:
                best, best_diff = ratio, diff
            elif diff == best_diff and width * height > 0.5 * self.tile_size ** 2 * ratio[0] * ratio[1]:
                best = ratio
        return best


def _resize(x: Any, height: int, width: int) -> Any:
    """torchvision's resize of a uint8 (1, 3, H, W) tensor: torch's antialiased bilinear kernel, uint8 out."""
    import torch.nn.functional as F

    if tuple(x.shape[-2:]) == (height, width):
        return x
    return F.interpolate(x, size=(height, width), mode="bilinear", align_corners=False, antialias=True)


def _rgb(image: Any) -> Any:
    return image if getattr(image, "mode", None) == "RGB" else load_image(image)
