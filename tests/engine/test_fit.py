"""Memory that fits itself (engine/fit.py, llama.cpp's --fit): the KV pool and context of stories260K sized to a
budget of bytes, against the arithmetic of its config (5 layers, 4 KV heads, head_dim 8, context 512: a float32
token is 2 x 5 x 4 x 8 x 4 = 1280 bytes, a block of 16 tokens 20480) and against the engine built from the fit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nexttoken.engine import EngineConfig, LLMEngine
from nexttoken.engine.fit import MIN_CONTEXT, fit_memory, fitted_config, runtime_bytes, weights_bytes
from nexttoken.errors import GenerationConfigError

BLOCK = 20480  # bytes of a 16-token float32 block


@pytest.fixture(scope="module")
def model(shared_dir: Path):
    import nexttoken

    return nexttoken.load(shared_dir / "models" / "stories260k").model


def test_weights_are_the_parameters_bytes(model) -> None:
    params = sum(p.numel() for p in model.parameters()) * 4  # float32, the tied embedding counted once
    assert params <= weights_bytes(model) <= params + sum(b.nbytes for b in model.buffers())


def test_a_large_budget_gives_what_the_sequences_need(model) -> None:
    config = EngineConfig(max_num_seqs=4)
    fit = fit_memory(model, config, 1 << 30)
    assert fit.max_model_len == 512 and fit.kv_tokens == 4 * 512
    assert fit.kv_cache_bytes == (4 * 512 // 16 + 1) * BLOCK  # the null block on top
    assert fit.total_bytes == fit.weights_bytes + fit.kv_cache_bytes + fit.runtime_bytes


def test_a_small_budget_shrinks_the_pool_then_the_context(model) -> None:
    config = EngineConfig(max_num_seqs=4)
    fixed = weights_bytes(model) + runtime_bytes(model, config)
    fit = fit_memory(model, config, fixed + 41 * BLOCK)  # 40 blocks and the null one: 640 tokens
    assert fit.kv_tokens == 640 and fit.max_model_len == 512 and fit.total_bytes == fixed + 41 * BLOCK
    fit = fit_memory(model, config, fixed + 19 * BLOCK + 100)  # 18 blocks: 288 tokens, less than one context
    assert fit.kv_tokens == 288 and fit.max_model_len == 288
    with pytest.raises(GenerationConfigError, match="raise --memory-budget"):
        fit_memory(model, config, fixed + (MIN_CONTEXT // 16) * BLOCK)  # one block short of MIN_CONTEXT
    short = EngineConfig(max_num_seqs=4, max_model_len=400)
    fixed = weights_bytes(model) + runtime_bytes(model, short)
    assert fit_memory(model, short, fixed + 26 * BLOCK).max_model_len == 400  # 25 blocks: 400 tokens
    with pytest.raises(GenerationConfigError, match="fewer than the 400"):  # a set context is kept, or refused
        fit_memory(model, short, fixed + 25 * BLOCK)


def test_the_engine_gets_the_fitted_pool_and_context(model) -> None:
    config = EngineConfig(max_num_seqs=4)
    fit = fit_memory(model, config, weights_bytes(model) + runtime_bytes(model, config) + 19 * BLOCK)
    engine = LLMEngine(model, None, fitted_config(config, fit))
    stats = engine.stats()
    assert stats.kv_cache_bytes == fit.kv_cache_bytes and stats.kv_tokens_total == fit.kv_tokens
    assert engine.max_model_len == fit.max_model_len == 288


def test_an_int8_pool_holds_more_tokens(model) -> None:
    config = EngineConfig(max_num_seqs=64, kv_cache_dtype="int8")
    budget = weights_bytes(model) + runtime_bytes(model, config) + 41 * BLOCK
    fit = fit_memory(model, config, budget, torch.int8)
    assert fit.kv_tokens == (41 * BLOCK // 7680 - 1) * 16  # an int8 block is 7680 bytes
