"""The model cards of Ollama's /api/tags, /api/ps and /api/show, from what the server says of each model it serves
(`ServedModel`: api/ollama.py's `served_models` gathers a loaded model's; router.py lists the registry's models, an
unloaded one by its name and files alone: `unloaded_card`)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from ..catalog import TAG
NEVER = datetime(9999, 12, 31, 23, 59, 59, tzinfo=timezone.utc)  # expires_at of a model that is never unloaded


@dataclass(frozen=True)
class ServedModel:
    """One model as a server serves it: its name, what it is, and where it lives."""

    name: str  # a name requests give it (the served name)
    architecture: str  # the family ("llama", "qwen2", ...)
    parameters: int  # parameter count
    size_bytes: int  # weights in memory
    dtype: str  # the weights' number format ("F32", "BF16", ...)
    context_length: int  # tokens a request may span
    embedding_length: int
    block_count: int
    head_count: int
    head_count_kv: int
    vocab_size: int
    template: str  # the chat template ("" without one)
    capabilities: tuple[str, ...]  # Ollama's: "completion", "tools", "thinking", "insert", "vision"
    loaded_at: datetime
    vram_bytes: int = 0  # weights on an accelerator
    expires_at: datetime | None = None  # when an idle unload is due (None: never)

    @property
    def tagged(self) -> str:
        return self.name if ":" in self.name else f"{self.name}:{TAG}"

    @property
    def digest(self) -> str:
        """A stable identity for the served weights (Ollama's is its manifest's sha256)."""
        what = f"{self.name} {self.architecture} {self.parameters} {self.dtype} {self.vocab_size}"
        return hashlib.sha256(what.encode()).hexdigest()


def matches(model: ServedModel, name: str) -> bool:
    """Whether a request's `model` names this one: its name, or its name with Ollama's default tag."""
    return name in (model.name, model.tagged)


def parameter_size(count: int) -> str:
    """Ollama's parameter_size: "260.0K", "135.0M", "7.2B"."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f}{unit}"
    return str(count)


def details(model: ServedModel) -> dict[str, Any]:
    return {"parent_model": "", "format": "safetensors", "family": model.architecture,
            "families": [model.architecture], "parameter_size": parameter_size(model.parameters),
            "quantization_level": model.dtype}


def tag_card(model: ServedModel) -> dict[str, Any]:
    """A model in /api/tags."""
    return {"name": model.tagged, "model": model.tagged, "modified_at": model.loaded_at.isoformat(),
            "size": model.size_bytes, "digest": model.digest, "details": details(model)}


def unloaded_card(name: str, size_bytes: int, modified_at: datetime) -> dict[str, Any]:
    """A model in /api/tags that is not loaded: its name, its files' size and time (its details come with its
    load)."""
    tagged = name if ":" in name else f"{name}:{TAG}"
    return {"name": tagged, "model": tagged, "modified_at": modified_at.isoformat(), "size": size_bytes,
            "digest": hashlib.sha256(f"{name} {size_bytes}".encode()).hexdigest(),
            "details": {"parent_model": "", "format": "", "family": "", "families": [],
                        "parameter_size": "", "quantization_level": ""}}


def ps_card(model: ServedModel) -> dict[str, Any]:
    """A loaded model in /api/ps: its memory (size_vram: on an accelerator), context, and when it unloads."""
    return {**tag_card(model), "expires_at": (model.expires_at or NEVER).isoformat(), "size_vram": model.vram_bytes,
            "context_length": model.context_length}


def show_card(model: ServedModel) -> dict[str, Any]:
    """/api/show: the template, the details, GGUF-style model_info keys, the capabilities."""
    arch = model.architecture
    info = {"general.architecture": arch, "general.parameter_count": model.parameters,
            f"{arch}.context_length": model.context_length, f"{arch}.embedding_length": model.embedding_length,
            f"{arch}.block_count": model.block_count, f"{arch}.attention.head_count": model.head_count,
            f"{arch}.attention.head_count_kv": model.head_count_kv, f"{arch}.vocab_size": model.vocab_size}
    return {"license": "", "modelfile": "", "parameters": "", "template": model.template, "details": details(model),
            "model_info": info, "capabilities": list(model.capabilities),
            "modified_at": model.loaded_at.isoformat()}
