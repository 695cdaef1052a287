"""LoadSpec: how a model is to be loaded (where from, precision, GGUF options, tensor parallelism, LoRA adapters,
a draft model), every value checked once, here, before a file is read.

The library (`nexttoken.load`), every command (generate, chat, replay, serve, bench) and the server build one
and hand it to `loading.load`, the one place that composes them. The commands' flags are derived from the
fields below (`add_load_args`), each with its help text and default, as the generation flags are derived from
GenerationConfig's fields. This module imports no torch: `nexttoken --help` reads it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from .errors import LoraError, ModelLoadError

# The allowed values (model/weights/loader.py's DTYPES, model/quant/quantize.py's QUANTIZATIONS and
# model/quant/ggml.py's ACTIVATIONS, named here so that the parser needs no torch; tests/test_loadspec.py checks
# they agree).
DTYPES = ("float32", "bfloat16", "float16")
QUANTIZATIONS = ("int8", "int4", "bf16")
GGUF_ACTIVATIONS = ("float32", "int16", "int8")
PREFILL_PRECISIONS = ("float32", "bfloat16")
DEVICES = ("cpu", "cuda", "mps", "xpu")

MODEL_HELP = ("a Hugging Face model folder, a .gguf file, or a Hub id: org/name (a folder's files), org/name:Q4_K_M "
              "(its GGUF file of that quantization)")


def _option(default: Any, help: str, shown: str | None = None, **argparse_kwargs: Any) -> Any:  # noqa: A002
    """A field with its flag's help text; `shown`: what the default means, when it is not the value itself."""
    return field(default=default, metadata={"help": help, "shown": shown, "argparse": argparse_kwargs})


@dataclass(frozen=True)
class LoadSpec:
    """What `load` reads, validated at construction (a ModelLoadError, or LoraError for the adapter fields,
    names the field and what it allows). `LoadSpec.of(**options)` refuses unknown names."""

    model: str | os.PathLike | None = _option(
        None, MODEL_HELP, "the model packaged with nexttoken", metavar="MODEL")
    revision: str | None = _option(None, "the Hub revision of --model: a branch, tag or commit", "main")
    gguf_file: str | None = _option(None, "the GGUF file of the Hub repository --model to load",
                                    "the one matching --model's :TAG", metavar="FILE")
    download_dir: str | os.PathLike | None = _option(
        None, "the Hugging Face cache folder to find and download Hub models in",
        "huggingface_hub's, ~/.cache/huggingface/hub or $HF_HUB_CACHE", metavar="DIR")
    tokenizer: str | os.PathLike | None = _option(
        None, "use this folder's or Hub id's tokenizer instead of the model's (e.g. for a GGUF file whose own "
        "tokenizer is not supported)", "the model's own", metavar="DIR_OR_ID")
    mmproj: str | os.PathLike | None = _option(
        None, "llama.cpp's multimodal projector file (mmproj-*.gguf: the vision encoder and projector that "
        "convert_hf_to_gguf.py --mmproj writes) to load beside a .gguf --model, so that it reads images",
        "none: the model's own (a folder's config.json declares its tower)", metavar="FILE")
    dtype: Any = _option(
        None, "weights dtype: docs/models.md#precision",
        "on CPU a bf16 checkpoint keeps bf16 weights with float32 activations, anything else float32; bfloat16 on "
        "accelerators", choices=DTYPES)
    device: Any = _option(None, "where the model runs: cpu, cuda or cuda:N", "cpu")
    quantize: str | None = _option(
        None, "weight-only quantization of the linear layers: int8 (per row), int4 (groups of 32), or bf16 "
        "(bfloat16 weights, float32 activations)", "none: the weights as stored", choices=QUANTIZATIONS)
    dequantize: bool = _option(
        False, "load a quantized GGUF file as the float32 model of its dequantized weights (the exact reference) "
        "instead of multiplying its blocks as stored (the file's size and speed)", "off")
    gguf_activations: str | None = _option(
        None, "how a packed GGUF's products take their inputs: float32 (exact: the file's own weights in float32), "
        "int16 per block of 32 (close), or int8 per block of 32 (llama.cpp's arithmetic: faster, inexact)",
        "the arithmetic policy's: float32 (model/arithmetic.py)", choices=GGUF_ACTIVATIONS)
    prefill: str | None = _option(
        None, "how weight-only layers (GGUF blocks, bf16, int8, int4) multiply a prompt's rows: float32 (exact) or "
        "bfloat16 GEMMs of bf16-rounded activations (llama.cpp's arithmetic: about twice as fast, inexact)",
        "the arithmetic policy's: float32 (NEXTTOKEN_PREFILL)", choices=PREFILL_PRECISIONS)
    mmap: bool = _option(
        True, "map a GGUF file rather than read it into memory (llama.cpp's default; --no-mmap reads it: the process "
        "no longer depends on the file, so truncating or replacing it cannot kill it with SIGBUS)", "on")
    tensor_parallel_size: int = _option(
        1, "shard the model over N ranks: N-1 local worker processes, or the ranks torchrun started "
        "(docs/tensor_parallel.md; a Hugging Face folder, not a GGUF file)", metavar="N")
    tensor_parallel_timeout: float = _option(
        60.0, "seconds a tensor-parallel rank may stay silent (a step, or an idle heartbeat) before the model "
        "stops", metavar="SECONDS")
    threads: int | None = _option(None, "torch intra-op threads", "torch's choice (one per core); with "
                                  "tensor parallelism, the cores split between the ranks", metavar="N")
    lora: Mapping[str, str | os.PathLike] | None = _option(
        None, "PEFT LoRA adapter folders (or Hub ids) by name: NAME=PATH, or vLLM's JSON "
        "'{\"name\": ..., \"path\": ...}' (docs/lora.md)", "none")
    merge_lora: bool = _option(
        False, "fold the one LoRA adapter into the weights (before --quantize, which then rounds the sum)", "off")
    max_loras: int | None = _option(None, "adapter slots: adapters applied at once",
                                    "the adapters given, at least 1 when adapters are enabled", metavar="N")
    max_cpu_loras: int | None = _option(
        None, "adapters registered at once (more than max_loras: an adapter takes a slot when a request needs it, the "
        "least recently used idle one's when none is free)", "max_loras when that is given (vLLM's), else no limit",
        metavar="N")
    max_lora_rank: int | None = _option(None, "largest adapter rank a slot holds; a larger adapter is refused",
                                        "the largest given adapter's rank, else 16", metavar="R")
    draft_model: str | os.PathLike | None = _option(
        None, "speculative decoding with this draft model (a folder, .gguf file or Hub id; it must share the "
        "model's tokenizer)", "none", metavar="MODEL")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _CHECKS.get(f.name, _no_check)(f.name, getattr(self, f.name))
        if self.lora is not None:
            object.__setattr__(self, "lora", _adapters(self.lora))  # a read-only copy, normalised
        if self.merge_lora and len(self.lora or {}) != 1:
            raise LoraError(f"merge=True folds one adapter into the weights: give exactly one in lora=, got "
                            f"{len(self.lora or {})}")
        if (self.lora or self.max_loras) and self.tensor_parallel_size != 1:
            raise LoraError("LoRA adapters do not run on a tensor-parallel model yet: use tensor_parallel_size=1")
        if self.tensor_parallel_size != 1 and self.quantize not in (None, "none", "int8"):
            raise ModelLoadError(f"quantize={self.quantize!r} does not run with tensor parallelism yet: use int8 or "
                                 "no quantization with tensor_parallel_size > 1")

    def __hash__(self) -> int:  # the adapters' mapping is not hashable; the spec is compared by value
        return hash(tuple((f.name, repr(getattr(self, f.name))) for f in dataclasses.fields(self)))

    @classmethod
    def of(cls, **options: Any) -> "LoadSpec":
        """A spec from keyword options, refusing a name that is not a field."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise ModelLoadError(f"unknown load option(s) {unknown}: the options are {', '.join(names)}")
        return cls(**options)

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides: Any) -> "LoadSpec":
        """A spec from the flags `add_load_args` added (fields without a flag keep their defaults)."""
        names = {f.name for f in dataclasses.fields(cls)}
        options = {k: v for k, v in vars(args).items() if k in names}
        if isinstance(options.get("model"), list) and "model" not in overrides:  # serve's --model, once per model
            if len(options["model"]) > 1:
                raise ModelLoadError(f"one spec loads one model; got {len(options['model'])} --model values")
            options["model"] = options["model"][0] if options["model"] else None
        if isinstance(options.get("lora"), (str, list, tuple)):  # --lora [NAME=]PATH, --lora-modules NAME=PATH ...
            given = options["lora"]
            options["lora"] = parse_adapters([given] if isinstance(given, str) else given) or None
        return cls.of(**{**options, **overrides})

    def replace(self, **changes: Any) -> "LoadSpec":
        return dataclasses.replace(self, **changes)

    @property
    def adapter_name(self) -> str | None:
        """The adapter a single-adapter run decodes under (None: none, or folded into the weights)."""
        return None if not self.lora or self.merge_lora else next(iter(self.lora))


def _no_check(name: str, value: Any) -> None:
    pass


def _text(name: str, value: Any) -> None:
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise ModelLoadError(f"{name} must be a string or a path, got {type(value).__name__} {value!r}")


def _choice(allowed: Iterable[str], none: str = "") -> Any:
    def check(name: str, value: Any) -> None:
        if value is None and none:
            return
        if value not in allowed:
            raise ModelLoadError(f"{name}={value!r} is not supported; use one of {', '.join(allowed)}{none}")
    return check


def _dtype(name: str, value: Any) -> None:
    if value is None or value == "auto" or (type(value).__module__ == "torch" and
                                            str(value).removeprefix("torch.") in DTYPES):
        return  # a torch.dtype is recognised without importing torch
    _choice(DTYPES, " (or leave it out for the default)")(name, value)


def _device(name: str, value: Any) -> None:
    if value is None:
        return
    kind, _, index = str(value).partition(":")
    if kind not in DEVICES or (index and not index.isdigit()):
        raise ModelLoadError(f"{name}={value!r} is not a device: use cpu, cuda, cuda:N, mps or xpu")


def _integer(low: int, none_ok: bool) -> Any:
    def check(name: str, value: Any) -> None:
        if value is None and none_ok:
            return
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ModelLoadError(f"{name} must be an integer >= {low}, got {value!r}")
    return check


def _flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ModelLoadError(f"{name} is True or False, got {value!r}")


def _seconds(name: str, value: Any) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise ModelLoadError(f"{name} must be a positive number of seconds, got {value!r}")


def _lora(name: str, value: Any) -> None:
    if value is not None and not (isinstance(value, Mapping) and all(
            isinstance(k, str) and k and isinstance(v, (str, os.PathLike)) for k, v in value.items())):
        raise LoraError(f"{name} maps adapter names to folders or Hub ids, e.g. {{'sql': 'path/to/adapter'}}; got "
                        f"{value!r}")


def _lora_count(name: str, value: Any) -> None:
    try:
        _integer(1, True)(name, value)
    except ModelLoadError as e:
        raise LoraError(str(e)) from None


_CHECKS = {
    "model": _text, "revision": _text, "gguf_file": _text, "download_dir": _text, "tokenizer": _text, "mmproj": _text,
    "draft_model": _text, "dtype": _dtype, "device": _device,
    "quantize": _choice(QUANTIZATIONS + ("none",), " or None"), "gguf_activations": _choice(GGUF_ACTIVATIONS, " or None"),
    "prefill": _choice(PREFILL_PRECISIONS, " or None"),
    "dequantize": _flag, "merge_lora": _flag, "tensor_parallel_size": _integer(1, False),
    "tensor_parallel_timeout": _seconds, "threads": _integer(1, True), "lora": _lora, "max_loras": _lora_count, "max_cpu_loras": _lora_count,
    "max_lora_rank": _lora_count,
}


def _adapters(lora: Mapping[str, Any]) -> Mapping[str, str]:
    """The adapters as a read-only name -> str mapping (a frozen spec holds no mutable dict)."""
    from types import MappingProxyType

    return MappingProxyType({name: os.fspath(path) for name, path in lora.items()})


def parse_adapters(specs: Iterable[str]) -> dict[str, str]:
    """Command-line adapters, vLLM's --lora-modules forms: "name=path", or JSON {"name": ..., "path": ...}; a bare
    path is named after its folder. Names must be unique."""
    from .model.lora.adapter import parse_modules  # no torch: adapter.py reads JSON and paths here

    return parse_modules(list(specs))


# ---- flags -------------------------------------------------------------------------------------------------------
SOURCE = ("model", "revision", "gguf_file", "download_dir", "dequantize", "gguf_activations", "tokenizer", "mmproj")
PRECISION = ("dtype", "device", "quantize", "prefill")


def add_load_args(p: Any, names: Iterable[str], flags: Mapping[str, Iterable[str]] | None = None,
                  **overrides: dict[str, Any]) -> None:
    """One flag per named field (--tensor-parallel-size for tensor_parallel_size), with the field's help text and
    default. `flags`: other option strings for a field (serve's --speculative-model, vLLM's name); `overrides`:
    argparse keywords that replace the field's for one command (serve's nargs="+" adapters)."""
    by_name = {f.name: f for f in dataclasses.fields(LoadSpec)}
    for name in names:
        f = by_name[name]
        kwargs = {**_kind(f), **f.metadata["argparse"], **overrides.get(name, {})}
        kwargs["help"] = f"{f.metadata['help']} (default: {kwargs.pop('shown', None) or _shown(f)})"
        p.add_argument(*(flags or {}).get(name, ["--" + name.replace("_", "-")]), dest=name, **kwargs)


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default: the text's own "(default: ...)" where it says what a flag left
    out means, else the value (off / on for switches)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or not action.option_strings or action.default is argparse.SUPPRESS:
            return text
        value = action.default
        shown = ("on" if value else "off") if isinstance(value, bool) else \
            "none" if value in (None, [], {}) else "%(default)s"
        return f"{text} (default: {shown})".lstrip()


def _kind(f: dataclasses.Field) -> dict[str, Any]:
    """argparse keywords for a field's type; a flag left out leaves the field's default."""
    if f.type == "bool":
        return {"action": "store_true"}
    if f.name == "lora":
        return {"action": "append", "metavar": "[NAME=]PATH"}
    kind = {"int": int, "int | None": int, "float": float}.get(f.type, str)
    return {"type": kind, "default": f.default}


def _shown(f: dataclasses.Field) -> str:
    return f.metadata["shown"] or str(f.default)
