"""int8 weight-only quantization: accuracy against float32 on real text, and the fast/slow paths agree."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import nexttoken
from nexttoken.errors import ModelLoadError
from nexttoken.generation import generate
from nexttoken.model import kernels, load_model
from nexttoken.model.quant.int8 import Int8Linear
from nexttoken.model.quant import quantize_int8
from support.tiny_models import save_variant

STORIES = Path(__file__).resolve().parents[4] / "shared" / "models" / "stories260k"
needs_stories = pytest.mark.skipif(not STORIES.is_dir(), reason=f"{STORIES} (shared data) is absent")


@needs_stories
def test_int8_agrees_with_float32_on_real_text() -> None:
    from nexttoken.bench.accuracy import int8_accuracy

    report = int8_accuracy(STORIES)
    assert report["tokens"] > 300
    # Measured 98.9-99.2% (3-4 near-tie flips in ~380 tokens) on this 64-wide model; KL ~5e-4 nats.
    assert report["top1_agreement"] >= 0.98
    assert report["kl_mean"] < 5e-3


@needs_stories
def test_load_quantize_generates_close_to_float32() -> None:
    llm = nexttoken.load(STORIES, quantize="int8")
    assert isinstance(llm.model.lm_head, Int8Linear)
    out = llm.generate("Once upon a time", max_new_tokens=12, do_sample=False)
    ref = nexttoken.load(STORIES).generate("Once upon a time", max_new_tokens=12, do_sample=False)
    assert out.token_ids[:4] == ref.token_ids[:4]


def test_unknown_quantization_is_a_typed_error(tmp_path) -> None:
    save_variant("llama-gqa", tmp_path)
    with pytest.raises(ModelLoadError, match="int3"):
        nexttoken.load(tmp_path, quantize="int3")


@pytest.mark.parametrize("variant", ["llama-tied-mha", "qwen2-bias"])
@pytest.mark.skipif(not kernels.available(), reason="native kernel unavailable")
def test_int8_kernel_and_torch_fallback_give_same_tokens(variant, tmp_path, monkeypatch) -> None:
    save_variant(variant, tmp_path)
    model = quantize_int8(load_model(tmp_path))
    ids = torch.tensor([[1, 5, 17, 33, 9], [1, 40, 41, 42, 43]])
    kwargs = dict(max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    fast = generate(model, ids, **kwargs)
    monkeypatch.setattr(kernels, "usable", lambda x, w: False)  # torch's _weight_int8pack_mm instead
    assert torch.equal(generate(model, ids, **kwargs), fast)


def test_int8_halves_weight_bytes(tmp_path) -> None:
    save_variant("llama-gqa", tmp_path)  # untied embeddings: the embedding gets its own int8 table
    model = load_model(tmp_path, dtype="bfloat16")
    before = sum(m.weight.nbytes for m in model.modules() if isinstance(m, torch.nn.Linear)) + model.embed.weight.nbytes
    quantize_int8(model)
    after = sum(m.weight.nbytes for m in model.modules() if isinstance(m, Int8Linear))
    assert after * 2 == before
    assert model.dtype == torch.bfloat16  # activations and cache stay bf16
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
