"""The arithmetic a model computes with: one policy object, held by the model and read where a choice is made.

Three choices change a model's numbers without changing its weights:

- `fused_step`: decode steps in one native call (fused.py, csrc/decode.cpp) where it applies, or the PyTorch
  modules (the reference it is tested against: the same tokens, logits within float32 rounding);
- `prefill`: how weight-only layers (bf16 weights, int8 rows, int4 groups, GGUF blocks) multiply a prompt's many
  rows (quant/tiles.py): "float32" (exact: the default) or "bfloat16" GEMMs of bf16-rounded activations (llama.cpp's
  trade: about twice the rate, log-probs off by up to ~0.2 on a real model);
- `gguf_activations`: how a packed GGUF matrix multiplies its inputs (quant/ggml.py): "float32" (exact: the blocks
  dequantized in registers, float32 FMAs; the default), "int16" (per block of 32; within ~4e-3 in log-prob) or
  "int8" (llama.cpp's arithmetic: fastest, and on SmolLM2's Q4_1 top-1 differs from the file's weights on ~3% of
  positions);
- `quantized_activations`: how nexttoken's own weight-only layers (`quantize="int8"` rows, `"int4"` groups) take
  their inputs at decode: "float32" (exact: the weights widened in registers, float32 FMAs; the default) or
  "integer" (int16 per row for int8 weights, int8 per group of 32 for int4: VNNI dot products, faster, inexact).

Defaults are exact: a quantized file gives the answers of its own weights computed in float32 (docs/performance.md,
Precision). llama.cpp's arithmetic is the opt-in `Arithmetic.llama_cpp()` (--prefill bfloat16
--gguf-activations int8). The defaults are this dataclass's fields; `Arithmetic.from_env()` lets NEXTTOKEN_FUSED=0
and NEXTTOKEN_PREFILL=bfloat16 change them, read when a model is built (model.arithmetic). The model passes its policy
down: fused.py reads `model.arithmetic`, the model's forward makes it the one in force for its layers
(`running`), quant/tiles.py reads `in_force()`. `changed(...)` is the scoped convenience behind
`fused.disabled()` and `tiles.precision(...)`: inside the block (this thread or task only) every policy read is
that policy with the changes, like decimal.localcontext.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
from dataclasses import dataclass
from typing import Iterator, Mapping

from ..errors import NextTokenError

PRECISIONS = ("float32", "bfloat16")  # prefill products: exact first
ACTIVATIONS = ("float32", "int16", "int8")  # GGUF packed products' activations: exact first
QUANTIZED_ACTIVATIONS = ("float32", "integer")  # int8 / int4 weight-only layers' activations: exact first


class ArithmeticPolicyError(NextTokenError, ValueError):
    """An arithmetic choice out of its allowed values (a field of Arithmetic or its environment variable)."""


@dataclass(frozen=True)
class Arithmetic:
    """How a model computes: the fused decode step on or off, the prefill products' precision, the GGUF packed
    products' activations. Immutable: a change is a new policy (`replace`)."""

    fused_step: bool = True
    prefill: str = "float32"
    gguf_activations: str = "float32"
    quantized_activations: str = "float32"

    def __post_init__(self) -> None:
        if not isinstance(self.fused_step, bool):
            raise ArithmeticPolicyError(f"fused_step={self.fused_step!r}: use True or False")
        if self.prefill not in PRECISIONS:
            raise ArithmeticPolicyError(f"prefill precision {self.prefill!r}: use one of {', '.join(PRECISIONS)}")
        if self.gguf_activations not in ACTIVATIONS:
            raise ArithmeticPolicyError(f"gguf_activations={self.gguf_activations!r}: use one of "
                                        f"{', '.join(ACTIVATIONS)}")
        if self.quantized_activations not in QUANTIZED_ACTIVATIONS:
            raise ArithmeticPolicyError(f"quantized_activations={self.quantized_activations!r}: use one of "
                                        f"{', '.join(QUANTIZED_ACTIVATIONS)}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "Arithmetic":
        """The defaults, changed by NEXTTOKEN_FUSED=0 (decode steps run the modules) and NEXTTOKEN_PREFILL
        (float32 or bfloat16)."""
        prefill = environ.get("NEXTTOKEN_PREFILL", cls.prefill)
        if prefill not in PRECISIONS:
            raise ArithmeticPolicyError(f"NEXTTOKEN_PREFILL={prefill!r}: use one of {', '.join(PRECISIONS)}")
        return cls(fused_step=environ.get("NEXTTOKEN_FUSED", "1") != "0", prefill=prefill)

    @classmethod
    def llama_cpp(cls) -> "Arithmetic":
        """llama.cpp's arithmetic: bf16 prefill GEMMs, 8-bit activations on GGUF blocks and integer activations on
        int8 / int4 weights (faster, inexact)."""
        return cls(prefill="bfloat16", gguf_activations="int8", quantized_activations="integer")

    def replace(self, **changes: object) -> "Arithmetic":
        """This policy with some choices changed (validated)."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ArithmeticPolicyError(f"unknown arithmetic choice(s) {unknown}: the choices are "
                                        f"{', '.join(f.name for f in dataclasses.fields(self))}")
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


# The policy of the model whose forward is running in this context (Transformer.forward), and the changes of the
# enclosing `changed` blocks: context-local (per thread / asyncio task), always restored on leaving the block.
_RUNNING: contextvars.ContextVar[Arithmetic | None] = contextvars.ContextVar("nexttoken_arithmetic", default=None)
_CHANGES: contextvars.ContextVar[tuple[tuple[str, object], ...]] = contextvars.ContextVar(
    "nexttoken_arithmetic_changes", default=())


def in_force(policy: Arithmetic | None = None) -> Arithmetic:
    """The policy to compute with here: `policy` (a model's), else the running model's, else the environment's
    defaults; with the changes of any enclosing `changed(...)` block applied."""
    if policy is None:
        policy = _RUNNING.get() or Arithmetic.from_env()
    changes = _CHANGES.get()
    return policy.replace(**dict(changes)) if changes else policy


@contextlib.contextmanager
def running(policy: Arithmetic) -> Iterator[None]:
    """Make `policy` the one in force for the layers called inside (a model's forward)."""
    token = _RUNNING.set(policy)
    try:
        yield
    finally:
        _RUNNING.reset(token)


@contextlib.contextmanager
def changed(**changes: object) -> Iterator[None]:
    """Inside the block, every policy read (any model's, or the defaults) has these choices changed: e.g.
    changed(fused_step=False) runs the modules' decode steps, changed(prefill="float32") exact prefills. A
    model's GGUF activations are how its layers were built: set model.arithmetic for those."""
    for name in ("gguf_activations", "quantized_activations"):
        if name in changes:
            raise ArithmeticPolicyError(f"{name} is how a model's quantized layers were built: set "
                                        f"model.arithmetic = model.arithmetic.replace({name}=...) instead")
    Arithmetic().replace(**changes)  # validated here, at the block, not at the first read
    token = _CHANGES.set(_CHANGES.get() + tuple(changes.items()))
    try:
        yield
    finally:
        _CHANGES.reset(token)
