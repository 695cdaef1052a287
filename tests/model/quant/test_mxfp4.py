"""MXFP4 blocks (gpt-oss's experts; GGUF type MXFP4) read natively (csrc/mxfp4.cpp) and in torch
(quant/mxfp4.py) against the `gguf` package's dequantizer, ggml's own Python definition: random blocks dequantize
to exactly its values (every exponent byte, subnormal scales included), and the packed product equals the float64
product of those values up to float32 rounding; the checkpoint's own layout (transformers' `*_blocks` /
`*_scales`) dequantizes to the same values as its ggml repacking."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from nexttoken.model import kernels
from nexttoken.model.quant import tiles
from nexttoken.model.quant.mxfp4 import Mxfp4Linear, dequantize_reference
from nexttoken.model.weights.stacked import dequantize_mxfp4, mxfp4_to_ggml

gguf = pytest.importorskip("gguf")
needs_kernel = pytest.mark.skipif(not kernels.mxfp4_available(), reason="needs the native kernels with AVX-512")


def random_rows(N: int, K: int, seed: int = 0, exponents: tuple[int, int] = (118, 130)) -> torch.Tensor:
    """(N, K / 32 * 17) uint8: random codes, exponent bytes in [lo, hi) (weights of about 2^-9 .. 2^3)."""
    gen = np.random.default_rng(seed)
    rows = gen.integers(0, 256, size=(N, K // 32, 17), dtype=np.uint8)
    rows[..., 0] = gen.integers(*exponents, size=(N, K // 32), dtype=np.uint8)
    return torch.from_numpy(rows.reshape(N, -1))


def reference(rows: torch.Tensor, K: int) -> torch.Tensor:
    with np.errstate(over="ignore"):  # the largest exponents overflow to inf, in both
        values = gguf.quants.dequantize(rows.numpy(), gguf.GGMLQuantizationType.MXFP4)
    return torch.from_numpy(np.ascontiguousarray(values).reshape(rows.shape[0], K))


def test_every_exponent_dequantizes_to_ggufs_values_bit_for_bit() -> None:
    rows = random_rows(256, 64, exponents=(0, 256))  # 0 and 1: subnormal scales; the largest overflow to inf
    rows[:, 0] = torch.arange(256, dtype=torch.uint8)  # each row's first block: every exponent once
    want = reference(rows, 64)
    assert torch.equal(dequantize_reference(rows, 64).view(torch.int32), want.view(torch.int32))
    if kernels.mxfp4_available():
        assert torch.equal(kernels.dequantize_mxfp4(rows, 64).view(torch.int32), want.view(torch.int32))


@needs_kernel
@pytest.mark.parametrize("M", [1, 3, 16])
def test_packed_product_is_the_float64_product_up_to_float32_rounding(M: int) -> None:
    N, K = 40, 96
    rows = random_rows(N, K, seed=M)
    bias = torch.randn(N)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M))
    w = reference(rows, K).double()
    exact = x.double() @ w.T + bias.double()
    got = kernels.linear_mxfp4(x, rows, K, bias)
    bound = 4 * K * torch.finfo(torch.float32).eps * (x.double().abs() @ w.abs().T + bias.double().abs())
    assert ((got.double() - exact).abs() <= bound).all()
    with torch.no_grad():
        assert torch.equal(Mxfp4Linear(rows, K, bias)(x), got)  # decode-sized: the kernel


def test_prefill_and_torch_fallback_equal_the_float_layer(monkeypatch) -> None:
    """More rows than the kernel takes: dequantized tiles and torch's float32 GEMM, the float layer's numbers; and
    where the kernels do not run, the torch dequantizer's."""
    N, K = 48, 64
    rows, bias = random_rows(N, K, seed=5), torch.randn(N)
    x = torch.randn(40, K)
    want = F.linear(x, reference(rows, K), bias)
    layer = Mxfp4Linear(rows, K, bias)
    with torch.no_grad():
        if kernels.mxfp4_available():
            with tiles.precision("float32"):
                assert torch.allclose(layer(x), want, atol=1e-5, rtol=1e-5)
        monkeypatch.setattr(kernels, "mxfp4_available", lambda: False)
        assert torch.equal(layer(x[:3]), F.linear(x[:3], reference(rows, K), bias))


def test_checkpoint_blocks_repack_to_ggml_rows_with_the_same_values() -> None:
    """transformers' MXFP4 layout (byte j holds elements 2j and 2j + 1) against ggml's (low nibbles 0-15, high
    16-31): the checkpoint's dequantizer and gguf's on the repacked rows give the same values."""
    gen = np.random.default_rng(1)
    blocks = torch.from_numpy(gen.integers(0, 256, size=(2, 5, 3, 16), dtype=np.uint8))  # (E, N, G, 16)
    scales = torch.from_numpy(gen.integers(110, 140, size=(2, 5, 3), dtype=np.uint8))
    ggml_rows = mxfp4_to_ggml(blocks, scales)  # (E, N, G * 17)
    assert ggml_rows.shape == (2, 5, 51)
    assert torch.equal(dequantize_mxfp4(blocks, scales).reshape(10, 96), reference(ggml_rows.reshape(10, 51), 96))
