"""Folding one adapter into a model's weights: W <- W + B @ A (scaling folded into B), for single-adapter use.

A float or bf16 matrix takes the update in its own dtype. A quantized matrix (int8 rows, int4 groups, bf16
weights of quant/) is dequantized, updated in float32 and quantized again with its own scheme: the merged
weights then carry that scheme's rounding of W + B @ A, so a merged quantized model is close to the adapter's
outputs but not equal to them (the unmerged low-rank product, run in float32 beside the quantized product, is).
`nexttoken.load(..., lora=..., merge=True, quantize=...)` merges before quantizing, so the weights are rounded once.
"""

from __future__ import annotations

import torch
from torch import nn

from ..quant.bf16 import BF16Linear
from ..quant.int4 import Int4Linear
from ..quant.int8 import Int8Linear
from .adapter import TARGETS, LoraAdapter
from .layers import LoraLinear, owners_of
from ...errors import LoraError


@torch.no_grad()
def merge_adapter(model: nn.Module, adapter: LoraAdapter) -> None:
    """Add the adapter's update to every matrix it changes, in place."""
    for layer, block in enumerate(model.layers):
        owners = owners_of(model, block)
        for target in TARGETS:
            delta = adapter.delta(layer, target)  # (out, in) float32
            if delta is None:
                continue
            owner, attr = owners[target]
            module = getattr(owner, attr, None)
            if module is None:
                raise LoraError(f"adapter {adapter.name!r} changes layer {layer}'s {target}, which this model "
                                "does not have (a mixture-of-experts MLP)")
            if isinstance(module, LoraLinear):  # merging under served adapters: the base layer takes it
                module.inner = _merged(module.inner, delta)
            else:
                setattr(owner, attr, _merged(module, delta))
    plan = model.__dict__.get("_fused_plan")
    if plan is not None:  # the native step's description points at the old weights' memory
        del model._fused_plan


def _merged(module: nn.Module, delta: torch.Tensor) -> nn.Module:
    """module with delta (out, in) added to its weight: in place for float weights, requantized otherwise."""
    if isinstance(module, nn.Linear):  # Linear, KeptLinear: float or bf16 weights, updated in their dtype
        module.weight += delta.to(module.weight.dtype)
        return module
    dense = {Int8Linear: lambda m: m.weight.float() * m.scale[:, None], Int4Linear: lambda m: m.dequantized(),
             BF16Linear: lambda m: m.weight.float()}.get(type(module))
    if dense is None:
        raise LoraError(f"cannot merge a LoRA adapter into a {type(module).__name__} layer")
    plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
    plain.weight = nn.Parameter(dense(module) + delta, requires_grad=False)
    if module.bias is not None:
        plain.bias = nn.Parameter(module.bias.float(), requires_grad=False)
    return type(module).from_linear(plain)  # quantized again with the layer's own scheme
