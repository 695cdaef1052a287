"""The native decode kernel against torch, and generation with it on vs off (the reference path)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nexttoken.generation import generate
from nexttoken.model import fused, kernels, load_model
from nexttoken.model.quant.int8 import quantize_rows
from support.tiny_models import PROMPTS, left_padded
from support.tiny_models import save_variant

needs_kernel = pytest.mark.skipif(not kernels.available(), reason="native kernel unavailable (no g++ or no AVX-512)")


@needs_kernel
@pytest.mark.parametrize("M", [1, 2, 3, 5, 8, 11, 16])
@pytest.mark.parametrize("N,K", [(37, 72), (64, 288), (200, 17)])
def test_float32_matches_torch(M: int, N: int, K: int) -> None:
    gen = torch.Generator().manual_seed(M * N + K)
    x, w, b = torch.randn(M, K, generator=gen), torch.randn(N, K, generator=gen), torch.randn(N, generator=gen)
    torch.testing.assert_close(kernels.linear(x, w, b), F.linear(x.double(), w.double(), b.double()).float(),
                               rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8", "int4"])
@pytest.mark.parametrize("N,K", [(37, 72), (300, 288), (40, 2100)])
def test_a_row_gives_the_same_numbers_whatever_rows_share_the_call(kind: str, N: int, K: int) -> None:
    """The engine's batch invariance rests on this: row m's outputs are bit-identical for every M (each row's sums
    in the same order; rows reduced 16 at a time, whole blocks or the last partial one)."""
    from nexttoken.model.quant.int4 import Int4Linear
    from nexttoken.model.quant.int8 import Int8Linear
    from nexttoken.model.linear import Linear

    gen = torch.Generator().manual_seed(N + K)
    lin = Linear(K, N, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(N, K, generator=gen) * 0.05)
        lin.bias.copy_(torch.randn(N, generator=gen))
    if kind == "bfloat16":
        lin = lin.to(torch.bfloat16)
    layer = {"int8": Int8Linear.from_linear, "int4": Int4Linear.from_linear}.get(kind, lambda m: m)(lin)
    x = torch.randn(16, K, generator=gen).to(torch.bfloat16 if kind == "bfloat16" else torch.float32)
    with torch.no_grad():
        alone = torch.cat([layer(x[m : m + 1]) for m in range(16)])
        for M in (2, 3, 5, 8, 11, 16):
            together = torch.cat([layer(x[m0 : m0 + M]) for m0 in range(0, 16, M)])
            assert torch.equal(together, alone), f"{kind}: rows differ when {M} share a call"


@needs_kernel
@pytest.mark.parametrize("M", [1, 4, 9])
def test_bfloat16_accumulates_in_float32(M: int) -> None:
    gen = torch.Generator().manual_seed(M)
    x, w = torch.randn(M, 1000, generator=gen).bfloat16(), torch.randn(96, 1000, generator=gen).bfloat16()
    exact = F.linear(x.double(), w.double())  # bf16 values are exact in float64
    got = kernels.linear(x, w)
    assert got.dtype == torch.bfloat16
    # One rounding of a float32 sum to bf16: within half a bf16 ulp (2^-8 relative) plus float32 slack.
    torch.testing.assert_close(got.double(), exact, rtol=2**-8, atol=1e-3)
    torch.testing.assert_close(got, F.linear(x, w), rtol=2**-7, atol=1e-2)  # torch's own bf16 linear


@needs_kernel
@pytest.mark.parametrize("M", [1, 3, 8])
def test_int8_matches_dequantized_weights(M: int) -> None:
    gen = torch.Generator().manual_seed(M)
    x, w = torch.randn(M, 130, generator=gen), torch.randn(50, 130, generator=gen)
    q, scale = quantize_rows(w)
    expected = F.linear(x.double(), q.double() * scale.double()[:, None])
    # Activations are taken as int16 with a per-row scale: error <= half a step per column, 2^-16 of |x|max.
    bound = (q.double().abs() * scale.double()[:, None]).sum(1) * x.abs().amax(1, keepdim=True).double() / 32767
    assert ((kernels.linear(x, q, None, scale).double() - expected).abs() <= bound + 1e-5).all()
    assert (q.float() * scale[:, None] - w).abs().max() <= scale.max() / 2 + 1e-6  # rounding, no clipping


@pytest.fixture(scope="module", params=["llama-gqa", "qwen2-bias", "mistral-sliding"])
def model(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    save_variant(request.param, directory)
    return load_model(directory)


@needs_kernel
def test_greedy_tokens_identical_with_kernel_off(model, monkeypatch) -> None:
    ids, mask = left_padded(PROMPTS)
    kwargs = dict(max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=0)
    fast = generate(model, ids, attention_mask=mask, **kwargs)
    monkeypatch.setattr(kernels, "usable", lambda x, w: False)  # every product through torch's F.linear
    reference = generate(model, ids, attention_mask=mask, **kwargs)
    assert torch.equal(fast, reference)


def test_single_row_prompt_and_batch_of_eight_agree(model) -> None:
    """Row 0 decoded alone (one-row kernel calls) or inside a batch of 8 (eight-row calls): same tokens."""
    ids, mask = left_padded([PROMPTS[1]] * 8)
    kwargs = dict(max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    batch = generate(model, ids, attention_mask=mask, **kwargs)
    alone = generate(model, ids[:1], attention_mask=mask[:1], **kwargs)
    assert torch.equal(batch, alone.expand(8, -1))


@torch.inference_mode()
@fused.disabled()  # the PyTorch modules' own unmasked step (the fused native step is tested in test_fused.py)
def test_plain_decode_step_skips_the_mask_and_matches_the_masked_step(model) -> None:
    from nexttoken.model import ForwardBatch

    P, S = 6, 9
    ids = torch.randint(5, model.config.vocab_size, (2, P + 1), generator=torch.Generator().manual_seed(3))
    valid = torch.ones(2, S, dtype=torch.bool)
    outs = []
    for unmasked in (True, False):
        cache = model.new_cache(2, S)
        cols = torch.arange(P).expand(2, P)
        model(ids[:, :P], ForwardBatch.build(cols, cols, valid, P, model.config.sliding_window, write_start=0), cache)
        pos = torch.full((2, 1), P)
        batch = ForwardBatch.build(pos, pos, valid, P + 1, model.config.sliding_window, write_start=P)
        assert (batch.mask is None) == (model.config.sliding_window is None or P + 1 <= model.config.sliding_window)
        if not unmasked and batch.mask is None:  # the reference: an explicit all-True mask
            batch.mask = batch.window_mask = torch.ones(2, 1, 1, P + 1, dtype=torch.bool)
        outs.append(model(ids[:, P:], batch, cache))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


def test_rope_roll_with_signed_sin_equals_rotate_half() -> None:
    from nexttoken.model.rope import apply_rope, rope_cos_sin

    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    x = torch.randn(2, 3, 5, 16)
    cos, signed_sin = rope_cos_sin(inv_freq, torch.arange(5).expand(2, 5), torch.float32)
    sin = torch.cat((-signed_sin[..., :8], signed_sin[..., 8:]), dim=-1)
    reference = x * cos + torch.cat((-x[..., 8:], x[..., :8]), dim=-1) * sin  # transformers' rotate_half
    assert torch.equal(apply_rope(x, cos, signed_sin), reference)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_rounds_like_torch(dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    q = torch.randint(-127, 128, (70, 37), dtype=torch.int8, generator=gen)  # 37: a masked tail every row
    scale = torch.rand(70, generator=gen) * 0.02
    assert torch.equal(kernels.dequantize(q, scale, dtype), (q.float() * scale[:, None]).to(dtype))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_int8_prefill_in_blocks_equals_one_dequantized_matrix(dtype, precision, monkeypatch) -> None:
    """Prefill in blocks (quant/tiles.py) is torch's one product with the whole dequantized matrix: in float32,
    exactly the float32 product; in bfloat16 (the default), the bf16 product of bf16-rounded activations."""
    from nexttoken.model.quant import int8, tiles

    monkeypatch.setattr(tiles, "BLOCK_BYTES", 64 * 96 * 4)  # several blocks and a short last one
    gen = torch.Generator().manual_seed(6)
    layer = int8.Int8Linear.from_linear(torch.nn.Linear(96, 300).to(dtype))
    x = torch.randn(80, 96, generator=gen).to(dtype)  # 80 rows: past the few-row kernels, the prefill path
    gemm = torch.bfloat16 if precision == "bfloat16" else dtype
    with torch.no_grad(), tiles.precision(precision):
        w = (layer.weight.float() * layer.scale[:, None]).to(gemm)
        expected = F.linear(x.to(gemm), w).to(dtype) + layer.bias.to(dtype)
        torch.testing.assert_close(layer(x), expected, rtol=0, atol=0)


@needs_kernel
def test_argmax_is_torch_argmax_including_ties_nan_and_inf() -> None:
    gen = torch.Generator().manual_seed(8)
    for shape in [(1, 32000), (3, 17), (8, 1000), (2, 1)]:
        x = torch.randn(*shape, generator=gen)
        assert torch.equal(kernels.argmax(x), x.argmax(-1)), shape
    nan, inf = float("nan"), float("inf")
    x = torch.tensor([[1.0, 5.0, 5.0, 2.0], [-inf] * 4, [1.0, nan, 9.0, nan], [3.0] * 4, [-inf, inf, 0.0, inf]])
    assert kernels.argmax(x).tolist() == x.argmax(-1).tolist() == [1, 0, 1, 0, 1]
    wide = torch.randn(4, 40, generator=gen)[:, ::2]  # not contiguous: torch's own argmax
    assert torch.equal(kernels.argmax(wide), wide.argmax(-1))


@needs_kernel
@pytest.mark.parametrize("quantize", [None, "int8", "int4", "bf16"])
def test_greedy_chain_gives_the_step_by_step_tokens(quantize, tmp_path, monkeypatch) -> None:
    """A plain greedy call of one row runs its steps natively, 16 per call (decode.greedy_chain); asking for each
    step's scores makes the loop go step by step in Python. Both give the same tokens, and an EOS id stops both
    at the same place, even in the middle of a chain."""
    from nexttoken.model.quant import apply_quantization

    save_variant("llama-gqa", tmp_path)
    model = apply_quantization(load_model(tmp_path), quantize)
    prompt = torch.tensor([PROMPTS[1]])
    P = prompt.shape[1]
    calls = []
    chain = fused.greedy_chain
    monkeypatch.setattr(fused, "greedy_chain", lambda *a: calls.append(a[5]) or chain(*a))
    kwargs = dict(max_new_tokens=37, do_sample=False, pad_token_id=0)

    def stepwise(eos):  # noqa: ANN001, ANN202
        return generate(model, prompt, eos_token_id=eos, output_scores=True, return_dict_in_generate=True,
                        **kwargs).sequences

    chained = generate(model, prompt, eos_token_id=None, **kwargs)
    assert calls == [16, 16, 4]  # the 36 steps after the first one
    reference = stepwise(None)
    assert len(calls) == 3  # the step-by-step call made none
    assert torch.equal(chained, reference)
    eos = int(reference[0, P + 20])  # first chosen at step 20 or earlier: inside the second chain at the latest
    calls.clear()
    stopped = generate(model, prompt, eos_token_id=eos, **kwargs)
    first = int((reference[0, P:] == eos).nonzero()[0])
    assert torch.equal(stopped, stepwise(eos)) and stopped.shape[1] == P + first + 1
    assert sum(calls) >= first  # it ran in chains
