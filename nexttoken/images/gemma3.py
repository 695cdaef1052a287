"""Gemma 3's image processor and its processor's placeholder expansion, as transformers 5.24's slow
`Gemma3ImageProcessor` (`use_fast=False`) and `Gemma3Processor` compute them, with Pillow and numpy.

Each image: resized to the checkpoint's size with its resample filter (Pillow, on the uint8 pixels), rescaled in
float64 then cast to float32, normalised with the mean and std in float32, channels first. Pan-and-scan is off by
default, as in transformers; a checkpoint that turns it on is refused by name. In the prompt each `<start_of_image>`
becomes "\\n\\n<start_of_image>" + mm_tokens_per_image x "<image_soft_token>" + "<end_of_image>\\n\\n"."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ImageError, ModelLoadError
from .prepared import Prepared

TOKENS = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


class Gemma3Images:
    """The preprocessing of one Gemma 3 checkpoint (its processor_config.json / preprocessor_config.json)."""

    def __init__(self, processor: dict[str, Any], image_seq_length: int, tokens: dict[str, str] | None = None) -> None:
        size = processor.get("size") or {"height": 224, "width": 224}
        self.size = (int(size["height"]), int(size["width"]))
        self.resample = int(processor.get("resample", 2))  # PIL.Image.BILINEAR
        self.do_resize = processor.get("do_resize", True)
        self.do_rescale = processor.get("do_rescale", True)
        self.rescale_factor = float(processor.get("rescale_factor", 1 / 255))
        self.do_normalize = processor.get("do_normalize", True)
        self.mean = np.array(processor.get("image_mean", [0.5, 0.5, 0.5]), dtype=np.float32)
        self.std = np.array(processor.get("image_std", [0.5, 0.5, 0.5]), dtype=np.float32)
        if processor.get("do_pan_and_scan"):
            raise ModelLoadError("this Gemma 3 checkpoint turns on pan-and-scan (do_pan_and_scan), which nexttoken "
                                 "does not implement yet; set it to false in its processor config")
        self.image_seq_length = int(image_seq_length)
        t = TOKENS | (tokens or {})
        self.placeholder = t["boi_token"]  # what a prompt marks each image's place with
        self.image_token = t["image_token"]  # the token whose embeddings the tower's rows replace
        self.full_sequence = f"\n\n{t['boi_token']}{t['image_token'] * self.image_seq_length}{t['eoi_token']}\n\n"

    @classmethod
    def from_dir(cls, folder: str | Path) -> "Gemma3Images":
        folder = Path(folder)
        proc = _json(folder / "processor_config.json")
        image = _json(folder / "preprocessor_config.json") or proc.get("image_processor") or {}
        config = _json(folder / "config.json")
        seq = proc.get("image_seq_length", image.get("image_seq_length", config.get("mm_tokens_per_image", 256)))
        tok = _json(folder / "tokenizer_config.json")  # boi_token, ... at its top level or in extra_special_tokens
        extra = tok.get("extra_special_tokens") if isinstance(tok.get("extra_special_tokens"), dict) else {}
        tokens = {k: v for k, v in {**tok, **extra}.items() if k in TOKENS and isinstance(v, str)}
        return cls(image, seq, tokens)

    @classmethod
    def from_settings(cls, image: dict[str, Any], processor: dict[str, Any], config: dict[str, Any],
                      source: str = "the image processor") -> "Gemma3Images":
        """From the image processor's settings (an mmproj GGUF's: size, mean, std, image_seq_length), the
        processor's and config.json; the tokens are Gemma 3's own."""
        seq = processor.get("image_seq_length", image.get("image_seq_length", config.get("mm_tokens_per_image", 256)))
        return cls(image, seq)

    def prepare(self, images: list[Any]) -> Prepared:
        """RGB PIL images -> Prepared: pixel_values (N, 3, H, W) float32, each image taking image_seq_length
        tokens."""
        pixels = [self._pixels(im) for im in images]
        h, w = self.size
        out = np.stack(pixels) if pixels else np.zeros((0, 3, h, w), dtype=np.float32)
        return Prepared(out, [self.image_seq_length] * len(images))

    def _pixels(self, image: Any) -> np.ndarray:
        from PIL import Image

        if image.mode != "RGB":
            image = image.convert("RGB")
        if self.do_resize:
            h, w = self.size
            image = image.resize((w, h), resample=Image.Resampling(self.resample))
        x = np.asarray(image).transpose(2, 0, 1)  # (3, H, W) uint8
        if self.do_rescale:
            x = (x.astype(np.float64) * self.rescale_factor).astype(np.float32)  # as transformers' rescale
        else:
            x = x.astype(np.float32)
        if self.do_normalize:
            x = ((x.T - self.mean) / self.std).T  # channels first, each channel's mean and std, in float32
        return np.ascontiguousarray(x, dtype=np.float32)

    def expand(self, text: str, prepared: Prepared) -> str:
        """The prompt with each image's `<start_of_image>` replaced by its full token sequence (one per image)."""
        found = text.count(self.placeholder)
        if found != len(prepared):
            raise ImageError(f"the prompt marks {found} image(s) with {self.placeholder!r} but {len(prepared)} "
                             f"image(s) were given: put one {self.placeholder} where each image goes, in order "
                             "(a chat's image parts do this for you)")
        return text.replace(self.placeholder, self.full_sequence)
