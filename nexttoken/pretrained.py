"""A model, loaded: the network, its tokenizer and its generation defaults (what `load` and `serve` read), from a
Hugging Face folder, a GGUF file or a Hub id (model/weights/hub.py says which is which)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .errors import MissingFileError, ModelLoadError
from .families import family
from .images import processor_for
from .generation.config import GenerationConfig
from .text.gguf_vocab import end_of_generation_ids, tokenizer_from_gguf
from .model import Transformer, load_model
from .model.weights.gguf import load_gguf_model
from .model.weights.hub import TOKENIZER_FILES, ModelSource, resolve_model
from .text.tokenizer import Tokenizer

DEFAULT_MODEL_DIR = Path(__file__).parent / "default_model"


@dataclass(frozen=True)
class Pretrained:
    model: Transformer
    tokenizer: Tokenizer | None  # None for token-id-only folders
    generation_config: GenerationConfig  # config.json's special tokens, then generation_config.json
    path: Path  # the local folder or .gguf file
    name: str = ""  # what the server and the CLI call it: the folder's name, the GGUF's stem, or the Hub id
    images: Any = None  # issue 43: the checkpoint's image preprocessing (images/<family>.py); None: text only


def default_model_path() -> Path:
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        raise MissingFileError(
            "nexttoken has no packaged default model in this installation: pass a model folder, "
            "e.g. nexttoken.load('path/to/model') or --model DIR"
        )
    return DEFAULT_MODEL_DIR


def resolve_source(
    path: str | Path | ModelSource | None, revision: str | None = None, download_dir: str | Path | None = None,
    gguf_file: str | None = None,
) -> ModelSource:
    """Where the model's files are: the packaged default (None), a folder, a .gguf file or a Hub id."""
    if isinstance(path, ModelSource):
        return path
    if path is None:
        if gguf_file or revision:
            raise ModelLoadError("--gguf-file and --revision need --model (a Hub id or a folder)")
        return ModelSource(default_model_path(), DEFAULT_MODEL_DIR.name)
    return resolve_model(path, revision, download_dir, gguf_file)


def load_pretrained(
    path: str | Path | ModelSource | None = None,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    quantize: str | None = None,
    model: Transformer | None = None,
    revision: str | None = None,
    download_dir: str | Path | None = None,
    gguf_file: str | None = None,
    tokenizer: str | Path | None = None,
    dequantize: bool = False,
    gguf_activations: str | None = None,
    mmap: bool = True,
) -> Pretrained:
    """Read a model (the packaged default model when path is None): a Hugging Face folder, a .gguf file, or a
    Hub id ("org/name", "org/name:Q4_K_M"; `revision`, `download_dir` = the Hub cache, `gguf_file`). `tokenizer`:
    a folder or Hub id whose tokenizer replaces the model's. `model`: the network loaded already (a
    tensor-parallel rank's shard); its tokenizer and defaults are read here. A quantized GGUF file's blocks stay
    packed (model/quant/ggml.py) unless `dequantize` (or `quantize`, which starts from float weights) is given.
    mmap=False (llama.cpp's --no-mmap): a GGUF file is read into anonymous memory instead of mapped, so the model
    no longer depends on the file (truncating a mapped file kills the process with SIGBUS at its next read)."""
    from .model.quant.quantize import apply_quantization

    source = resolve_source(path, revision, download_dir, gguf_file)
    if source.is_gguf:
        if model is not None:
            raise ModelLoadError(f"{source.path}: GGUF files load on one rank; tensor parallelism needs a folder")
        network, g = load_gguf_model(source.path, dtype=dtype, device=device,
                                     dequantize=dequantize or quantize not in (None, "none"),
                                     activations=gguf_activations, mmap=mmap)
        model = apply_quantization(network, quantize)
        tok = None  # a file without tokenizer.ggml.* is used with token ids, like a folder without tokenizer.json
        if tokenizer is None and "tokenizer.ggml.model" in g.metadata:
            tok = tokenizer_from_gguf(g.metadata, str(source.path))
        mc = model.config
        # llama.cpp ends generation at every end-of-generation token (EOS, EOT, <|im_end|>, ...), not EOS alone.
        eos = end_of_generation_ids(g.metadata) or mc.eos_token_id
        gen = GenerationConfig(bos_token_id=mc.bos_token_id, eos_token_id=eos, pad_token_id=mc.pad_token_id)
    else:
        if model is None:
            model = load_model(source.path, dtype=dtype, device=device, quantize=quantize)
        mc = model.config
        gen = GenerationConfig(bos_token_id=mc.bos_token_id, eos_token_id=mc.eos_token_id,
                               pad_token_id=mc.pad_token_id)
        gen_file = source.path / "generation_config.json"
        if gen_file.is_file():
            gen = GenerationConfig.from_file(gen_file, base=gen)
        tok = None if tokenizer is not None else Tokenizer.maybe_from_dir(source.path)
    if tokenizer is not None:
        folder = resolve_model(tokenizer, download_dir=download_dir, files=TOKENIZER_FILES).path
        if not folder.is_dir():
            raise ModelLoadError(f"--tokenizer {tokenizer}: a tokenizer comes from a folder or Hub id with a "
                                 "tokenizer.json, not a file")
        tok = Tokenizer.from_dir(folder)
        if tok.vocab_size > model.config.vocab_size:
            raise ModelLoadError(f"--tokenizer {tokenizer}: its {tok.vocab_size} ids do not fit the model's "
                                 f"vocabulary of {model.config.vocab_size}; pass the model's own tokenizer")
    model.generation_config = gen  # the low-level generate(model, ...) uses the same defaults
    vision = family(model.config.architecture).vision if getattr(model, "vision", None) is not None else None
    images = None if source.is_gguf else processor_for(vision, source.path)
    return Pretrained(model, tok, gen, source.path, source.name, images)
