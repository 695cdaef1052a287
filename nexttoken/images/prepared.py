"""What a vision family's preprocessing hands the encoder: one prompt's images as pixel values, how many
placeholder tokens each takes, and the family's other inputs (VISION.md's interface; vcore owns this module and the
lead unifies it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Prepared:
    """pixel_values: float32, in the family's layout; tokens: per image, the placeholder tokens it takes in the
    prompt (the rows its features fill); extra: the family's other inputs (rows and columns, masks, grids)."""

    pixel_values: np.ndarray
    tokens: list[int]
    extra: dict[str, Any] = field(default_factory=dict)
