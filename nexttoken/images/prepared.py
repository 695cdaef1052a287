"""What a family's preprocessing hands the engine: the pixels in the family's layout and the placeholder tokens each
image takes (images/<family>.py make it; model/vision/<family>.py encode it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Prepared:
    """Some images, preprocessed as the family's transformers image processor does.

    pixel_values: float32, the family's layout (Gemma 3: (N, 3, H, W)); tokens: the placeholder tokens each image
    takes in the prompt, one entry per image; extra: the family's other inputs (image_grid_thw, masks, ...)."""

    pixel_values: np.ndarray
    tokens: list[int]
    extra: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class PromptImage:
    """One image of a request as the engine carries it: prepared alone (its features never depend on the other
    images: the encoder cache keys them by `hash`), and the prompt columns [start, end) its placeholders span
    (a prefill chunk never splits them)."""

    prepared: Prepared  # this image alone
    hash: str  # source.content_hash of its pixels
    start: int
    end: int

    @property
    def tokens(self) -> int:
        return self.prepared.tokens[0]


def joined(parts: list[Prepared]) -> Prepared:
    """Several Prepared (each image prepared alone) as one, in order: pixel values and the extra arrays
    concatenated along their first axis, the tokens listed."""
    extra: dict[str, Any] = {}
    for key in parts[0].extra if parts else ():
        values = [p.extra[key] for p in parts]
        if isinstance(values[0], np.ndarray):
            extra[key] = np.concatenate(values)
        else:
            extra[key] = [v for x in values for v in (x if isinstance(x, list) else [x])]
    pixels = np.concatenate([p.pixel_values for p in parts]) if parts else np.zeros((0,), dtype=np.float32)
    return Prepared(pixels, [t for p in parts for t in p.tokens], extra)
