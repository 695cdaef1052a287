"""Shared helpers for the decoding tests (no tests here): a tiny model pair and left-padded prompts."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path


from nexttoken.model import load_model
from support.tiny_models import PROMPTS, left_padded, save_variant  # noqa: F401 - PROMPTS and left_padded for the tests


@functools.lru_cache(maxsize=None)
def model_pair(variant: str = "llama-gqa"):  # noqa: ANN201
    """(transformers model, nexttoken model) on the same random weights, built once per test session."""
    directory = Path(tempfile.mkdtemp(prefix=f"nt-{variant}-"))
    hf = save_variant(variant, directory)
    return hf, load_model(directory)
