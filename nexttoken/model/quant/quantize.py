"""Weight-only int8 quantization: every linear layer (and the embedding) keeps int8 weights with one float32
scale per output row; activations, norms, attention and the KV cache stay in the model's dtype.

At decode the weights are read once per step, so halving their bytes (vs bf16) nearly doubles tokens/s; the
native kernel widens them to float32 in registers and accumulates in float32.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ...errors import ModelLoadError
from .bf16 import BF16Embedding, BF16Linear
from .int4 import Int4Linear
from .int8 import Int8Embedding, Int8Linear
from ..linear import Linear
from ..memory import release_freed_memory, repack

QUANTIZATIONS = ("int8", "int4", "bf16")


@torch.no_grad()
def quantize_int8(model: nn.Module) -> nn.Module:
    """Replace the model's linear layers (and embedding) with int8 weight-only versions, in place."""
    dtype = model.dtype
    tied = model.lm_head.weight is model.embed.weight
    _replace_linears(model, Int8Linear.from_linear)
    table = model.lm_head if tied else Int8Linear.from_linear(_as_linear(model.embed.weight))
    model.embed = Int8Embedding(table, dtype)
    return _finish(model, "int8")


@torch.no_grad()
def quantize_int4(model: nn.Module) -> nn.Module:
    """Replace the model's block linear layers with 4-bit group-wise versions (int4.py), in place. The LM head
    and the embedding keep int8 rows (shared when tied), as llama.cpp's Q4_0 files keep their output matrix at 6
    bits: the head's error goes straight into the logits (int4 there cost the packaged model 2.4 points of top-1
    agreement with float32), and the embedding is read one row per token, so its bytes cost no speed."""
    dtype = model.dtype
    tied = model.lm_head.weight is model.embed.weight
    head = Int8Linear.from_linear(model.lm_head)
    table = head if tied else Int8Linear.from_linear(_as_linear(model.embed.weight))
    model.lm_head = head
    _replace_linears(model.layers, Int4Linear.from_linear)
    model.embed = Int8Embedding(table, dtype)
    return _finish(model, "int4")


@torch.no_grad()
def quantize_bf16(model: nn.Module, repack: bool = True) -> nn.Module:
    """bfloat16 weights, float32 everything else (bf16.py), in place: every linear layer and the embedding keep
    bf16 weights (shared, not copied, when they are bf16 already) and the remaining parameters (norms) become
    float32, so the activations are float32. repack=False: the weights stay where they are (the loader read them
    into their arena already as bf16 / float32; moving them would be a second copy)."""
    tied = model.lm_head.weight is model.embed.weight
    _replace_linears(model, BF16Linear.from_linear)
    table = model.lm_head if tied else BF16Linear.from_linear(_as_linear(model.embed.weight))
    model.embed = BF16Embedding(table)
    for p in model.parameters():  # buffers (the bf16 weights) stay as they are
        p.data = p.data.float()
    return _finish(model, "bf16", repack)


def _replace_linears(root: nn.Module, make: Callable[[Linear], nn.Module]) -> None:
    """Every `Linear` under root (not KeptLinear: routers stay float) replaced by make(it), in place."""
    for module in list(root.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, Linear):
                setattr(module, name, make(child))


def _finish(model: nn.Module, kind: str, move: bool = True) -> nn.Module:
    model.quantization = kind
    release_freed_memory()  # the float weights just replaced
    if move:
        repack(model)  # the new weights onto huge pages too (memory.py), like the loader's float ones
        release_freed_memory()
    return model


def _as_linear(weight: torch.Tensor) -> nn.Linear:
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    lin.weight = nn.Parameter(weight, requires_grad=False)
    return lin


def apply_quantization(model: nn.Module, quantize: str | None) -> nn.Module:
    """`quantize` None/"none" leaves the model as it is; "int8" or "int4" quantizes its weights; "bf16" stores them
    as bfloat16 with float32 activations."""
    if quantize in (None, "none"):
        return model
    if quantize not in QUANTIZATIONS:
        raise ModelLoadError(f"quantize={quantize!r} is not supported; use one of {', '.join(QUANTIZATIONS)} or None")
    done = getattr(model, "quantization", None)
    if done == quantize:  # e.g. a bf16 checkpoint, loaded with bf16 weights by default
        return model
    if done is not None:
        raise ModelLoadError(f"the model's weights are {done} already, so they cannot become {quantize}: load the "
                             f"checkpoint with quantize={quantize!r} (or dtype='float32') instead")
    return {"int8": quantize_int8, "int4": quantize_int4, "bf16": quantize_bf16}[quantize](model)
