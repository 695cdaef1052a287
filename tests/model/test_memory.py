"""Weights packed into one huge-page arena (nexttoken/model/memory.py): same values, ties kept, aligned."""

from __future__ import annotations

import mmap

import torch

from nexttoken.generation import generate
from nexttoken.model import load_model
from nexttoken.model.memory import ALIGN, HUGE_PAGE, copy_into_arena, huge_page_arena, repack
from nexttoken.model.quant import quantize_int8
from support.tiny_models import save_variant


def test_arena_is_huge_page_aligned_or_absent() -> None:
    assert huge_page_arena(1000) is None  # too small to be worth a huge page
    arena = huge_page_arena(3 * HUGE_PAGE + 5)
    if arena is not None:  # None only where the OS has no MADV_HUGEPAGE
        assert arena.data_ptr() % HUGE_PAGE == 0 and arena.numel() == 3 * HUGE_PAGE + 5
        assert int(arena.sum()) == 0


def test_copy_into_arena_keeps_values_dtypes_and_ties() -> None:
    gen = torch.Generator().manual_seed(0)
    big = torch.randn(1100, 1000, generator=gen)  # 2.2 MB in bf16: enough for an arena
    tensors = {"a": big, "tied": big, "b": torch.randn(3, 5, generator=gen), "i": torch.arange(7), "s": torch.tensor(2.5)}
    expected = {k: v.clone() for k, v in tensors.items()}
    out = copy_into_arena(dict(tensors), torch.bfloat16)
    assert out["a"] is out["tied"]
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux: packed, the first tensor at the arena's 2 MiB-aligned start
        assert out["a"].data_ptr() % HUGE_PAGE == 0
        assert out["b"].data_ptr() == out["a"].data_ptr() + out["a"].nbytes  # 2.2 MB is a multiple of 64
    for name, value in expected.items():
        assert out[name].dtype == torch.bfloat16 and out[name].shape == value.shape
        assert torch.equal(out[name], value.to(torch.bfloat16))
        assert out[name].data_ptr() % ALIGN == 0
        assert out[name].data_ptr() != value.data_ptr()
    kept = copy_into_arena({"x": big})  # no dtype: each keeps its own
    assert kept["x"].dtype == torch.float32 and torch.equal(kept["x"], big)


def test_loaded_and_quantized_models_generate_the_same_from_the_arena(tmp_path) -> None:
    save_variant("llama-tied-mha", tmp_path)
    model = load_model(tmp_path)
    assert model.lm_head.weight is model.embed.weight
    ids = torch.tensor([[1, 5, 17, 33], [1, 40, 41, 42]])
    kwargs = dict(max_new_tokens=12, do_sample=False, eos_token_id=None)
    before = generate(model, ids, **kwargs)
    params = {name: p for name, p in model.named_parameters()}
    values = {name: p.detach().clone() for name, p in params.items()}
    repack(model)
    for name, p in model.named_parameters():
        assert p is params[name] and torch.equal(p, values[name])  # same Parameter objects, same values
    assert model.lm_head.weight is model.embed.weight
    assert torch.equal(generate(model, ids, **kwargs), before)
    quantized = quantize_int8(load_model(tmp_path))  # repacked inside quantize_int8
    assert quantized.embed.table is quantized.lm_head
    assert generate(quantized, ids, **kwargs).shape == before.shape
