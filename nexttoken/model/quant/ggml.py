"""GGUF's quantized blocks kept as the file stores them: `GGUFLinear` multiplies them natively, `GGUFEmbedding`
dequantizes only the rows it looks up.

A GGUF file's Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q2_K / Q3_K / Q4_K / Q5_K / Q6_K matrices are rows of ggml blocks
(ggml-common.h); csrc/ggml.cpp multiplies them as stored, so a 4-bit file reads its 4.5-5 bits a weight per token
instead of the 32 of the dequantized float32 model. By default (activations "float32") each block is dequantized
in registers and multiplied by the float32 activations: the numbers of the file's own weights in float32, which
is what the exactness tests hold it to. "int8" quantizes the activations per block of 32 as llama.cpp does (ggml's
Q8_0 / Q8_1: less arithmetic per weight, inexact), "int16" in between. Prefill dequantizes a cache-sized block of rows at a time (exactly gguf's values) and
runs torch's GEMM on it, as quant/int4.py does. `LLM.load(..., dequantize=True)` gives the float32 model instead,
the exact reference (transformers' GGUF loader computes the same numbers).

A matrix is one or more row ranges (`parts`), each of one type: a fused q/k/v or gate/up matrix of a Q4_K_M file
mixes Q4_K and Q6_K rows. The rows of a part are views of the file's memory map where the file's rows are used as
they are (o, down, the LM head and token table), else one copy of the packed bytes (the fused and the re-ordered
q/k rows), never a float copy.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from ..native_abi import GGML_F32, GGML_MIXED, GGML_Q16, NtLinear, weight_rows
from ..arithmetic import ACTIVATIONS, Arithmetic
from . import tiles
from .bf16 import TableEmbedding

# ggml type name -> id (ggml.h's enum ggml_type): the block types csrc/ggml.cpp multiplies.
GGML_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11, "Q4_K": 12,
              "Q5_K": 13, "Q6_K": 14}
MIXED = GGML_MIXED  # csrc/nt_abi.h's type for a matrix of several parts
Q16 = GGML_Q16  # csrc/nt_abi.h's flag on the type: int16 activations instead of int8
# activations -> the flag on the type (csrc/nt_abi.h): float32 (exact), int16, or int8 (no flag: llama.cpp's)
FLAGS = {"float32": GGML_F32, "int16": GGML_Q16, "int8": 0}


def native_blocks() -> bool:
    """Whether GGUF blocks are multiplied natively here (csrc/ggml.cpp: AVX-512 VNNI and F16C)."""
    return kernels.ggml_available()


def block_shape(name: str) -> tuple[int, int]:
    """(elements, bytes) of one block of the ggml type `name` (gguf's GGML_QUANT_SIZES)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType[name]]


def _dequantize_reference(packed: torch.Tensor, ggml_type: int, K: int) -> torch.Tensor:
    """(N, K) float32 by gguf-py's numpy dequantizer: where the native kernels do not run."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    values = dequantize(packed.numpy(), GGMLQuantizationType(ggml_type))
    return torch.from_numpy(np.ascontiguousarray(values).reshape(packed.shape[0], K))


class GGUFLinear(nn.Module):
    """y = x @ W^T + bias with W (N, K) as GGUF blocks: `parts` [(rows (n, row bytes) uint8, ggml type id)], whose
    row ranges stacked make W."""

    def __init__(self, parts: list[tuple[torch.Tensor, int]], in_features: int, bias: torch.Tensor | None,
                 activations: str | None = None) -> None:
        super().__init__()
        activations = Arithmetic.gguf_activations if activations is None else activations  # the policy's default
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations={activations!r}: use one of {', '.join(ACTIVATIONS)}")
        self.in_features, self.activations = in_features, activations
        self.out_features = sum(int(rows.shape[0]) for rows, _ in parts)
        self.types = [int(t) for _, t in parts]
        for i, (rows, _) in enumerate(parts):  # (n_i, row bytes_i) uint8: "weight" is the first (often only) part
            self.register_buffer("weight" if i == 0 else f"weight{i}", rows)
        self.register_buffer("bias", bias)  # (N,) float32 or None
        self._describe()

    @property
    def parts(self) -> list[tuple[torch.Tensor, int]]:
        names = ["weight"] + [f"weight{i}" for i in range(1, len(self.types))]
        return [(self._buffers[n], t) for n, t in zip(names, self.types)]

    @property
    def type_name(self) -> str:
        names = {v: k for k, v in GGML_TYPES.items()}
        return "+".join(sorted({names[t] for t in self.types}))

    def _describe(self) -> None:
        """native_kind / native_weight: what nt_linear reads (one part: its blocks; several: a description)."""
        parts, flag = self.parts, FLAGS[self.activations]
        if len(parts) == 1:
            self.native_kind, self.native_weight = kernels.GGML_KIND + (parts[0][1] | flag), parts[0][0]
            return
        desc = [len(parts)]
        for rows, t in parts:
            desc += [rows.shape[0], t, rows.data_ptr()]
        self.native_kind = kernels.GGML_KIND + (MIXED | flag)
        self.native_weight = torch.tensor(desc, dtype=torch.int64)

    def native(self) -> NtLinear | None:
        """The kernels' description (native_abi.describe): W_GGML + the blocks' type, where ggml.cpp runs here."""
        return weight_rows(self.native_weight, self.bias, kind=self.native_kind) if kernels.ggml_available() else None

    def use_arithmetic(self, policy: Arithmetic) -> None:
        """A model's policy (Transformer.arithmetic): its gguf_activations chooses how this layer quantizes."""
        if policy.gguf_activations != self.activations:
            self.activations = policy.gguf_activations
            self._describe()

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202 - nn.Module's: a move re-points the description
        out = super()._apply(fn, recurse)
        self._describe()
        return out

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(N, K) weights of `dtype`: gguf's dequantized values (float32 exactly; bfloat16 rounded once)."""
        return torch.cat([self._rows(rows, t, dtype) for rows, t in self.parts])

    def _rows(self, rows: torch.Tensor, ggml_type: int, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
        if rows.device.type == "cpu" and kernels.ggml_available():
            return kernels.dequantize_ggml(rows.contiguous(), ggml_type, self.in_features, dtype, out=out)
        return _dequantize_reference(rows.cpu(), ggml_type, self.in_features).to(rows.device, dtype)

    def _tile(self, a: int, b: int, dtype: torch.dtype, out: torch.Tensor | None) -> torch.Tensor:
        """Rows [a, b) of W (the parts stacked) as (b - a, K) `dtype`, part by part into out's storage when given."""
        K, pieces, n0, at = self.in_features, [], 0, 0
        for rows, t in self.parts:
            lo, hi = max(a, n0), min(b, n0 + rows.shape[0])
            if lo < hi:
                pieces.append(self._rows(rows[lo - n0 : hi - n0], t, dtype, out=None if out is None else out[at * K :]))
                at += hi - lo
            n0 += rows.shape[0]
        if out is not None:
            return out[: (b - a) * K].view(b - a, K)
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, K = x.shape[:-1], self.in_features
        x2 = x.reshape(-1, K)  # (M, K)
        native = (x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and not torch.is_grad_enabled()
                  and kernels.ggml_available())
        if native and x2.shape[0] <= kernels.MAX_ROWS:  # decode: the blocks streamed once for all rows
            return kernels.linear_ggml(x, self.native_weight, self.native_kind - kernels.GGML_KIND, K, self.bias,
                                       self.out_features)
        # prefill: a cache-sized block of rows dequantized at a time (quant/tiles.py), no float copy of W
        y = tiles.matmul(x2, self.out_features,
                         lambda a, b, dtype, out: self._tile(a, b, dtype, out if native else None))  # (M, N)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, blocks={self.type_name}, "
                f"activations={self.activations}")


class GGUFEmbedding(TableEmbedding):
    """Embedding rows read from a GGUFLinear's blocks (a tied LM head shares them): only the looked-up rows are
    dequantized, as float32."""

    def native_table(self) -> NtLinear | None:
        """The token table as csrc/decode.cpp's embed reads it (native_abi.describe_table): the table's blocks as
        its products read them, each looked-up row dequantized by ggml.cpp's nt_ggml_row, the values of `forward`.
        With it a greedy decode of a GGUF file runs natively in chains (generation/decode.py's greedy_chain)."""
        return self.table.native()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)  # (T,)
        if ((flat < 0) | (flat >= self.table.out_features)).any():
            raise IndexError(f"token id out of range for an embedding of {self.table.out_features} rows")
        parts = self.table.parts
        if len(parts) == 1:  # the usual table: one type
            rows, t = parts[0]
            return self.table._rows(rows.index_select(0, flat), t, torch.float32).view(*ids.shape, -1)  # (..., C)
        out = torch.empty((flat.shape[0], self.table.in_features), dtype=torch.float32, device=ids.device)
        n0 = 0
        for rows, t in self.table.parts:
            hit = (flat >= n0) & (flat < n0 + rows.shape[0])
            if hit.any():
                picked = rows.index_select(0, flat[hit] - n0)  # (t, row bytes): the looked-up rows' blocks
                out[hit] = self.table._rows(picked, t, torch.float32)
            n0 += rows.shape[0]
        return out.view(*ids.shape, -1)  # (..., C)
