"""Shared helpers for the decoding tests (no tests here): a tiny model pair and left-padded prompts."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import torch

from nexttoken.model import load_model
from tiny_models import save_variant

PROMPTS = [[1, 5, 17, 33], [1, 40, 41, 42, 43, 44, 45, 46, 47], [1, 90, 3, 3, 8, 12]]


def left_padded(prompts: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


@functools.lru_cache(maxsize=None)
def model_pair(variant: str = "llama-gqa"):  # noqa: ANN201
    """(transformers model, nexttoken model) on the same random weights, built once per test session."""
    directory = Path(tempfile.mkdtemp(prefix=f"nt-{variant}-"))
    hf = save_variant(variant, directory)
    return hf, load_model(directory)
