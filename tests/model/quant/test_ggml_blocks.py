"""GGUF's quantized blocks read natively (csrc/ggml.cpp) against the `gguf` package, ggml's own Python definitions.

For every block type: random blocks (random bits, valid float16 scales) dequantize to exactly gguf.quants.dequantize's
values, and the packed product equals the quantized activations times those weights (computed in float64) up to
float32 rounding, so it differs from the float product by no more than the activations' 8-bit rounding does."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nexttoken.model import kernels
from nexttoken.model.quant.ggml import GGML_TYPES, block_shape
from nexttoken.model.quant.int4 import quantize_activations

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not kernels.ggml_available(), reason="needs the native kernels with AVX-512 VNNI")

# Byte offsets of each type's float16 fields (ggml-common.h's block structs).
HALVES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82), "Q3_K": (108,),
          "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(name: str, N: int, K: int, seed: int = 0) -> torch.Tensor:
    """(N, row bytes) uint8: random bits with every float16 field a finite value of a weight's size."""
    gen = np.random.default_rng(seed)
    block, size = block_shape(name)
    rows = gen.integers(0, 256, size=(N, K // block, size), dtype=np.uint8)
    for at in HALVES[name]:
        rows[..., at:at + 2] = (gen.standard_normal((N, K // block, 1)) * 0.02).astype(np.float16).view(np.uint8)
    return torch.from_numpy(rows.reshape(N, -1))


def reference(packed: torch.Tensor, name: str, K: int) -> torch.Tensor:
    qtype = gguf.GGMLQuantizationType[name]
    return torch.from_numpy(gguf.quants.dequantize(packed.numpy(), qtype).reshape(packed.shape[0], K))


@pytest.mark.parametrize("name", GGML_TYPES)
def test_dequantized_rows_equal_gguf(name: str) -> None:
    block, _ = block_shape(name)
    for N, K in ((3, block), (17, 4 * block + (32 if block == 32 else 0)), (5, 7 * block)):
        packed = random_blocks(name, N, K, seed=N)
        want = reference(packed, name, K)
        got = kernels.dequantize_ggml(packed, GGML_TYPES[name], K, torch.float32)
        assert torch.equal(got, want), name
        bf = kernels.dequantize_ggml(packed, GGML_TYPES[name], K, torch.bfloat16)
        assert torch.equal(bf, want.to(torch.bfloat16))


def quantize_activations16(x: torch.Tensor) -> torch.Tensor:
    """(M, K) float64: what the int16 activations stand for (per block of 32: scale = max |x| / 32767, values
    rounded half to even)."""
    M, K = x.shape
    g = x.view(M, K // 32, 32)
    scale = g.abs().amax(-1, keepdim=True) / 32767
    q = torch.where(scale > 0, torch.round(g / torch.where(scale > 0, scale, 1.0)), 0.0)
    return (q.double() * scale.double()).view(M, K)


@pytest.mark.parametrize("name", GGML_TYPES)
def test_a_looked_up_row_is_its_dequantized_row(name: str) -> None:
    """ggml.cpp's nt_ggml_row (the native step's token table lookup) gives gguf's values of that row, from one type's
    blocks (with the product's flags on the type) and from a description of row ranges of two types; an id past
    the rows or K not whole blocks is refused."""
    lib, t = kernels.library(), GGML_TYPES[name]
    block, _ = block_shape(name)
    K = 4 * block
    packed, other = random_blocks(name, 9, K, seed=3), random_blocks("Q8_0", 5, K, seed=4)
    want = torch.cat([reference(packed, name, K), reference(other, "Q8_0", K)])  # (14, K)
    desc = torch.tensor([2, 9, t, packed.data_ptr(), 5, GGML_TYPES["Q8_0"], other.data_ptr()], dtype=torch.int64)
    out = torch.empty(K)
    for i in (0, 4, 8):
        assert lib.nt_ggml_row(t | 512, packed.data_ptr(), i, K, out.data_ptr()) == 0
        assert torch.equal(out, want[i]), (name, i)
    for i in (0, 8, 9, 13):
        assert lib.nt_ggml_row(255 | 512, desc.data_ptr(), i, K, out.data_ptr()) == 0
        assert torch.equal(out, want[i]), (name, i)
    assert lib.nt_ggml_row(255, desc.data_ptr(), 14, K, out.data_ptr()) == 1
    assert lib.nt_ggml_row(t, packed.data_ptr(), 0, K + 16, out.data_ptr()) == 1


@pytest.mark.parametrize("flags", [0, 256, 512])  # int8, int16 and float32 activations
def test_a_matrix_of_row_ranges_is_the_product_of_its_rows(flags: int) -> None:
    """A description of row ranges at their own addresses (type 255: a fused q/k/v or gate/up kept as views of the
    file): parts of one type are one pass over their rows, parts of two types a product each; both give the bits
    of the product of those rows in one matrix (its parts' products side by side), the same for every row count."""
    K, gen = 256, torch.Generator().manual_seed(5)
    for names in (["Q4_0", "Q4_0", "Q4_0"], ["Q8_0", "Q8_0"], ["Q4_K", "Q6_K"], ["Q6_K", "Q4_K", "Q4_K"]):
        parts = [random_blocks(n, rows, K, seed=i) for i, (n, rows) in enumerate(zip(names, (37, 16, 9)))]
        desc = torch.tensor([len(parts)] + [v for n, p in zip(names, parts) for v in (p.shape[0], GGML_TYPES[n],
                                                                                        p.data_ptr())])
        N = sum(p.shape[0] for p in parts)
        for M in (1, 3, 9):
            x = torch.randn(M, K, generator=gen)
            got = kernels.linear_ggml(x, desc, 255 | flags, K, N=N)
            if len(set(names)) == 1:
                want = kernels.linear_ggml(x, torch.cat(parts), GGML_TYPES[names[0]] | flags, K)
            else:
                want = torch.cat([kernels.linear_ggml(x, p, GGML_TYPES[n] | flags, K) for n, p in zip(names, parts)], 1)
            assert torch.equal(got, want), (names, M)


@pytest.mark.parametrize("name", GGML_TYPES)
def test_int16_activations_product(name: str) -> None:
    """Type | 256: int16 activations per block of 32 (vpdpwssd): the float product within ~2^-15 per block."""
    block, _ = block_shape(name)
    K, N = (2 * block if block == 256 else 5 * block), 21
    packed = random_blocks(name, N, K, seed=3)
    w = reference(packed, name, K).double()
    gen = torch.Generator().manual_seed(1)
    for M in (1, 4, 11):
        x = torch.randn(M, K, generator=gen)
        got = kernels.linear_ggml(x, packed, GGML_TYPES[name] | 256, K).double()
        xq = quantize_activations16(x)
        size = xq.abs() @ w.abs().T
        assert ((got - xq @ w.T).abs() <= 2e-6 * size + 1e-6).all(), name
        assert ((got - x.double() @ w.T).abs() <= 1e-4 * size + 1e-6).all(), name  # ~2^-15 of each block's max


@pytest.mark.parametrize("name", GGML_TYPES)
def test_product_is_quantized_activations_times_the_blocks(name: str) -> None:
    block, _ = block_shape(name)
    K = 3 * block if block == 256 else 9 * block  # an odd number of 32-blocks: a half chunk at the end
    N = 37  # not a multiple of 16
    packed = random_blocks(name, N, K, seed=7)
    w = reference(packed, name, K).double()  # (N, K)
    gen = torch.Generator().manual_seed(0)
    bias = torch.randn(N, generator=gen)
    for M in (1, 2, 3, 8, 9, 16):
        x = torch.randn(M, K, generator=gen) * torch.rand(1, K, generator=gen)  # uneven magnitudes per column
        q, scale = quantize_activations(x)  # per block of 32: scale = max |x| / 127, q rounded half to even
        xq = (q.double().view(M, -1, 32) * scale.double()[..., None]).view(M, -1)[:, :K]  # (M, K) what is multiplied
        got = kernels.linear_ggml(x, packed, GGML_TYPES[name], K, bias).double()
        want = xq @ w.T + bias.double()
        size = xq.abs() @ w.abs().T  # the products' magnitude: float32 rounding is relative to it
        assert ((got - want).abs() <= 2e-6 * size + 1e-6).all(), (name, M, (got - want).abs().max())
        # and the float product differs by the activations' rounding alone
        exact = x.double() @ w.T + bias.double()
        assert ((got - exact).abs() <= 1.01 * ((x.double() - xq).abs() @ w.abs().T) + 2e-6 * size + 1e-6).all()
        # each row's numbers are the same whatever rows share the call (batch invariance)
        alone = kernels.linear_ggml(x[-1:], packed, GGML_TYPES[name], K, bias)
        assert torch.equal(alone[0], got[-1].float())


@pytest.mark.parametrize("name", GGML_TYPES)
def test_float32_activations_product_is_the_float_product(name: str) -> None:
    """Type | 512 (the default): the blocks dequantized in registers times float32 activations: the float64 product
    of gguf's dequantized weights and the activations, up to float32 rounding (no activation rounding at all);
    each row's numbers the same whatever rows share the call."""
    block, _ = block_shape(name)
    K = 3 * block if block == 256 else 9 * block  # an odd number of 32-blocks: a half chunk at the end
    N = 37
    packed = random_blocks(name, N, K, seed=11)
    w = reference(packed, name, K).double()  # (N, K)
    gen = torch.Generator().manual_seed(2)
    bias = torch.randn(N, generator=gen)
    for M in (1, 2, 5, 8, 9, 16):
        x = torch.randn(M, K, generator=gen) * torch.rand(1, K, generator=gen)
        got = kernels.linear_ggml(x, packed, GGML_TYPES[name] | 512, K, bias).double()
        want = x.double() @ w.T + bias.double()
        size = x.double().abs() @ w.abs().T
        assert ((got - want).abs() <= 2e-6 * size + 1e-6).all(), (name, M, (got - want).abs().max())
        alone = kernels.linear_ggml(x[-1:], packed, GGML_TYPES[name] | 512, K, bias)
        assert torch.equal(alone[0], got[-1].float())
