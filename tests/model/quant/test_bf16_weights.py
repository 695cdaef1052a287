"""quantize="bf16": bfloat16 weights with float32 activations take the fused native step and keep the modules'
tokens; against transformers in float32 on the same (bf16-rounded) weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import nexttoken
from nexttoken.generation import generate
from nexttoken.model import fused, kernels, load_model
from nexttoken.model.quant.bf16 import BF16Linear
from nexttoken.model.quant import tiles
from nexttoken.model.quant import quantize_bf16
from support.tiny_models import save_variant

STORIES = Path(__file__).resolve().parents[4] / "shared" / "models" / "stories260k"
needs_stories = pytest.mark.skipif(not STORIES.is_dir(), reason=f"{STORIES} (shared data) is absent")
needs_kernel = pytest.mark.skipif(not kernels.available(), reason="native kernel unavailable (no g++ or no AVX-512)")
PROMPTS = torch.tensor([[1, 5, 17, 33, 9, 60], [1, 40, 41, 42, 43, 44], [1, 90, 3, 3, 8, 12]])


def fused_calls(monkeypatch) -> list[bool]:  # noqa: ANN001
    """Whether each native call (generate's decode_step and, for one greedy row, greedy_chain; the engine's
    decode_rows) ran; recorded as it returns."""
    calls: list[bool] = []
    for name in ("decode_step", "greedy_chain", "decode_rows"):
        real = getattr(fused, name)

        def counting(*args, real=real):  # noqa: ANN002, ANN202
            out = real(*args)
            calls.append(out is not None)
            return out

        monkeypatch.setattr(fused, name, counting)
    return calls


@needs_kernel
@pytest.mark.parametrize("variant", ["llama-gqa", "llama-tied-mha", "qwen2-bias"])
@pytest.mark.parametrize("rows", [1, 3])
def test_fused_step_gives_the_modules_tokens(variant, rows, tmp_path, monkeypatch) -> None:
    save_variant(variant, tmp_path)
    model = quantize_bf16(load_model(tmp_path))
    assert model.dtype == torch.float32 and model.layers[0].mlp.w2.weight.dtype == torch.bfloat16
    calls = fused_calls(monkeypatch)
    kwargs = dict(max_new_tokens=24, do_sample=False, eos_token_id=None)
    fast = generate(model, PROMPTS[:rows], **kwargs)
    assert calls and all(calls)
    with fused.disabled():
        assert torch.equal(fast, generate(model, PROMPTS[:rows], **kwargs))


def test_equals_transformers_in_float32_on_the_rounded_weights(tmp_path) -> None:
    """The independent reference: transformers' float32 generate with every weight rounded to bf16."""
    hf = save_variant("llama-gqa", tmp_path)
    model = quantize_bf16(load_model(tmp_path))
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 2:
                p.copy_(p.to(torch.bfloat16).float())
    ids = PROMPTS[:1]
    expected = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    assert torch.equal(generate(model, ids, max_new_tokens=24, do_sample=False, eos_token_id=None), expected)


def test_prefill_blocks_equal_one_product() -> None:
    """Prefill (quant/tiles.py): by default the float32 product of the widened weights (exact); with the
    bfloat16 opt-in the bf16 product of bf16-rounded activations (llama.cpp's BF16 matmul), widened."""
    lin = torch.nn.Linear(96, 4000, bias=True)
    layer = BF16Linear.from_linear(lin)
    x = torch.randn(70, 96)
    with torch.no_grad():
        expected = torch.nn.functional.linear(x, layer.weight.float(), layer.bias)
        assert torch.allclose(layer(x), expected, atol=1e-5)
        fast = torch.nn.functional.linear(x.bfloat16(), layer.weight).float() + layer.bias
        with tiles.precision("bfloat16"):
            assert torch.equal(layer(x), fast)


@needs_stories
def test_stories260k_bf16_weights_keep_the_modules_tokens(monkeypatch) -> None:
    llm = nexttoken.load(STORIES, quantize="bf16")
    calls = fused_calls(monkeypatch)
    out = llm.generate("Once upon a time", max_new_tokens=40, do_sample=False)
    assert calls and all(calls)
    with fused.disabled():
        assert llm.generate("Once upon a time", max_new_tokens=40, do_sample=False).token_ids == out.token_ids
