"""The one loading path: a LoadSpec in, the loaded model out, with its adapters attached and its draft model.

`nexttoken.load`, every command (generate, chat, replay, serve, bench) and the server call `load` here; the
spec has checked each value already (loadspec.py), so this module only composes: where the files are
(pretrained.resolve_source), the LoRA merge into float weights, the tensor-parallel shards (engine/launch.py),
the network with its tokenizer and defaults (pretrained.load_pretrained), the adapter slots, the draft model.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .collector import paused
from .errors import ModelLoadError
from .loadspec import LoadSpec
from .model import load_model
from .model.lora import attach, merge_adapter, read_adapter
from .model.quant.quantize import apply_quantization
from .model.weights.hub import ModelSource, resolve_adapter
from .model.weights.loader import resolve_dtype
from .pretrained import Pretrained, load_pretrained, resolve_source

DEFAULT_LORA_RANK = 16  # slots' rank when no adapter is given to size them (vLLM's --max-lora-rank default)


@dataclass(frozen=True)
class Loaded:
    """What a spec loads: the model (`main`: network, tokenizer, defaults, path, name) and the draft model of
    speculative decoding (None without `draft_model`)."""

    main: Pretrained
    draft: Pretrained | None
    spec: LoadSpec


def load(spec: LoadSpec, on_failure=None) -> Loaded:  # noqa: ANN001 - on_failure(message) of a tensor-parallel rank
    """Load what `spec` says. `on_failure`: called when a tensor-parallel rank dies or hangs (the server stops).
    The cyclic garbage collector is paused meanwhile: a load makes hundreds of thousands of long-lived objects (the
    vocabulary, the modules) and no garbage cycles, and each full collection it would trigger walks every object of
    the process (~60 ms with torch imported). What it defers is collected after, as usual."""
    with paused():
        return _load(spec, on_failure)


def _load(spec: LoadSpec, on_failure=None) -> Loaded:  # noqa: ANN001
    if spec.threads:
        torch.set_num_threads(spec.threads)
    source = resolve_source(spec.model, spec.revision, spec.download_dir, spec.gguf_file)
    if spec.tensor_parallel_size != 1 and source.is_gguf:
        raise ModelLoadError(f"{source.path}: tensor parallelism loads Hugging Face folders, not GGUF files")
    model = _merged(source, spec) if spec.merge_lora else None
    if spec.tensor_parallel_size != 1:
        from .engine.launch import load_sharded

        model = load_sharded(source.path, spec.tensor_parallel_size, spec.dtype, spec.device, spec.quantize,
                             spec.tensor_parallel_timeout, on_failure=on_failure, threads=spec.threads)
    main = load_pretrained(source, spec.dtype, spec.device, spec.quantize, model=model, tokenizer=spec.tokenizer,
                           dequantize=spec.dequantize, gguf_activations=spec.gguf_activations, mmap=spec.mmap,
                           download_dir=spec.download_dir)
    if spec.mmproj is not None:
        main = _with_mmproj(main, spec.mmproj, source)
    if spec.prefill is not None:  # the prompt products' precision (model/arithmetic.py): float32 unless asked
        main.model.arithmetic = main.model.arithmetic.replace(prefill=spec.prefill)
    if not spec.merge_lora and (spec.lora or spec.max_loras or spec.max_cpu_loras):
        _attach_adapters(main.model, spec)
    return Loaded(main, _draft(spec, main) if spec.draft_model is not None else None, spec)


def _with_mmproj(main: Pretrained, path: str, source: ModelSource) -> Pretrained:
    """A text GGUF with llama.cpp's projector file beside it: the tower read back from the file hung on the model
    (as a folder's is), its preprocessing from the file's settings, the image token from the text's vocabulary."""
    import dataclasses

    from .images import processor_from_settings
    from .model import vision
    from .model.weights.mmproj import read_mmproj

    if not source.is_gguf:
        raise ModelLoadError(f"--mmproj {path}: a projector file goes beside a .gguf model; {source.path} is a "
                             "model folder, whose config.json declares its own vision tower")
    mm = read_mmproj(path)
    images = processor_from_settings(mm.kind, mm.image_settings, {}, mm.config, str(mm.path))
    token = main.tokenizer.token_to_id(images.image_token) if main.tokenizer is not None else None
    if token is None:
        raise ModelLoadError(f"--mmproj {path}: the model's vocabulary has no {images.image_token!r} token: pass the "
                             f"text model converted from the same checkpoint as the projector")
    tower = vision.build(mm.kind, {**mm.config, "image_token_id": token}, mm.tensors).to(main.model.device)
    object.__setattr__(main.model, "vision", tower)  # beside the decoder's modules, as weights/loader.py hangs it
    return dataclasses.replace(main, images=images)


def _fetch_adapter(spec: LoadSpec):  # noqa: ANN202
    return functools.partial(resolve_adapter, download_dir=spec.download_dir)  # lora= values that are Hub ids


def _merged(source: ModelSource, spec: LoadSpec):  # noqa: ANN202
    """The float model with the one adapter folded into its weights, then quantized as asked (the sum rounded
    once)."""
    from .errors import LoraError

    if source.is_gguf:
        raise LoraError(f"{source.path}: merge=True folds an adapter into a model folder's float weights, not a "
                        "GGUF file's: serve the adapter unmerged (lora= without merge)")
    (name, folder), = spec.lora.items()  # type: ignore[union-attr]
    # The adapter is added to float weights (a bf16 checkpoint widened on CPU), then quantized as asked.
    model = load_model(source.path, dtype=spec.dtype or resolve_dtype(None, torch.device(spec.device or "cpu")),
                       device=spec.device)
    merge_adapter(model, read_adapter(name, folder, model.config, resolve=_fetch_adapter(spec)))
    return apply_quantization(model, spec.quantize)


def _attach_adapters(model, spec: LoadSpec) -> None:  # noqa: ANN001
    """The model's adapter slots (max_loras, at least the adapters given) with the adapters read into them; a bad
    adapter stops the load here."""
    fetch = _fetch_adapter(spec)
    adapters = [read_adapter(name, folder, model.config, spec.max_lora_rank, fetch)
                for name, folder in (spec.lora or {}).items()]
    rank = spec.max_lora_rank or max([a.rank for a in adapters], default=DEFAULT_LORA_RANK)
    registry = attach(model, spec.max_loras or max(len(adapters), 1), rank,
                      spec.max_cpu_loras if spec.max_cpu_loras is not None else spec.max_loras)
    for adapter in adapters:
        registry.register(adapter)


def _draft(spec: LoadSpec, main: Pretrained) -> Pretrained:
    """The draft model, at the model's dtype and device; it must share the model's tokenizer."""
    draft = load_pretrained(spec.draft_model, dtype=spec.dtype, device=spec.device, download_dir=spec.download_dir)
    if _vocab(draft) != _vocab(main):
        raise ModelLoadError(f"the draft model {spec.draft_model} has a different tokenizer from the model: a draft "
                             "model must share it")
    return draft


def _vocab(loaded: Pretrained) -> object:
    tok = loaded.tokenizer
    return tok.backend.get_vocab() if tok is not None else loaded.model.config.vocab_size
