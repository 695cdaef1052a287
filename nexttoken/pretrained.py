"""A model folder, loaded: the network, its tokenizer and its generation defaults (what `load` and `serve` read)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import MissingFileError
from .generation.config import GenerationConfig
from .model import Transformer, load_model
from .tokenizer import Tokenizer

DEFAULT_MODEL_DIR = Path(__file__).parent / "default_model"


@dataclass(frozen=True)
class Pretrained:
    model: Transformer
    tokenizer: Tokenizer | None  # None for token-id-only folders
    generation_config: GenerationConfig  # config.json's special tokens, then generation_config.json
    path: Path


def default_model_path() -> Path:
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        raise MissingFileError(
            "nexttoken has no packaged default model in this installation: pass a model folder, "
            "e.g. nexttoken.load('path/to/model') or --model DIR"
        )
    return DEFAULT_MODEL_DIR


def load_pretrained(
    path: str | Path | None = None,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    quantize: str | None = None,
    model: Transformer | None = None,
) -> Pretrained:
    """Read a Hugging Face model folder (the packaged default model when path is None). `model`: the folder's
    network loaded already (a tensor-parallel rank's shard); its tokenizer and defaults are read here."""
    from .model.quant.quantize import apply_quantization

    path = Path(path) if path is not None else default_model_path()
    if model is None:
        model = apply_quantization(load_model(path, dtype=dtype, device=device), quantize)
    mc = model.config
    gen = GenerationConfig(bos_token_id=mc.bos_token_id, eos_token_id=mc.eos_token_id, pad_token_id=mc.pad_token_id)
    gen_file = path / "generation_config.json"
    if gen_file.is_file():
        gen = GenerationConfig.from_file(gen_file, base=gen)
    model.generation_config = gen  # the low-level generate(model, ...) uses the same defaults
    return Pretrained(model, Tokenizer.maybe_from_dir(path), gen, path)
