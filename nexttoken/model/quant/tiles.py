"""Prefill through weight tiles: how a weight-only layer (bf16 weights, int8 rows, int4 groups, GGUF blocks) runs
a prompt's many rows, where the native decode kernels (a handful of rows) are the wrong tool.

A block of output rows is dequantized at a time into a cache-sized buffer and handed to torch's GEMM, so no float
copy of the whole matrix ever exists (1 GB for a 1B model's LM head in float32). Two precisions:

- "float32" (the default, exact): tiles widened to float32 and torch's float32 GEMM: the float32 modules' numbers
  on the stored weights.
- "bfloat16" (opt-in: --prefill bfloat16, NEXTTOKEN_PREFILL=bfloat16): the activations are rounded to bfloat16 once per product, the tiles are dequantized
  to bfloat16 (a bf16 matrix is used as stored) and torch's bf16 GEMM (oneDNN; AVX512-BF16 on Zen 4 and later
  Xeons) sums in float32 at about twice the float32 GEMM's rate; its output is rounded to bf16, then widened.
  This is llama.cpp's own trade: it rounds a BF16 matrix's activations to bf16 too, and a quantized matrix's
  further, to 8 bits. On SmolLM2's Q4_1 it moves prompt log-probs by up to ~0.2 and the top-1 token on ~2% of
  positions. Decode steps never take this path: they run the native kernels.

The choice is the model's arithmetic policy (model/arithmetic.py: `model.arithmetic.prefill`, in force while its
forward runs); `NEXTTOKEN_PREFILL=bfloat16` makes bfloat16 the default of the models built after, and
`with tiles.precision("float32"):` the choice inside the block.
"""

from __future__ import annotations

from typing import Callable, ContextManager

import torch
import torch.nn.functional as F

from ..arithmetic import PRECISIONS, ArithmeticPolicyError, changed, in_force

BLOCK_BYTES = 4 << 20  # dequantized weights per GEMM: cache-sized, large enough to run at the GEMM's full rate


# tile(n0, n1, dtype, out) -> rows n0..n1 of W (n1 - n0, K) in dtype, written into out's storage when it can
Tile = Callable[[int, int, torch.dtype, torch.Tensor], torch.Tensor]


def precision(name: str) -> ContextManager[None]:
    """Prefill products in `name` ("bfloat16" or "float32") inside the block (arithmetic.changed(prefill=name))."""
    if name not in PRECISIONS:
        raise ArithmeticPolicyError(f"prefill precision {name!r}: use one of {', '.join(PRECISIONS)}")
    return changed(prefill=name)


def gemm_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a prompt's product runs in: bf16 for float32 CPU activations unless the arithmetic in force
    (the running model's, arithmetic.in_force) asks for exact float32."""
    fast = in_force().prefill == "bfloat16" and x.dtype == torch.float32 and x.device.type == "cpu"
    return torch.bfloat16 if fast else x.dtype


def matmul(x: torch.Tensor, N: int, tile: Tile, element_bytes: int | None = None) -> torch.Tensor:
    """x (M, K) @ W^T -> (M, N) in x's dtype, W given a block of rows at a time by `tile`."""
    M, K = x.shape
    dtype = gemm_dtype(x)
    xs = x.to(dtype)  # rounded once for every block
    size = torch.tensor([], dtype=dtype).element_size()
    rows = max(64, BLOCK_BYTES // (K * (element_bytes or size)))
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    buffer = torch.empty(min(rows, N) * K, dtype=dtype, device=x.device)
    for n0 in range(0, N, rows):
        w = tile(n0, min(n0 + rows, N), dtype, buffer)  # (rows, K) in dtype
        y[:, n0 : n0 + w.shape[0]] = F.linear(xs, w)  # a bf16 product is widened here, exactly
    return y
