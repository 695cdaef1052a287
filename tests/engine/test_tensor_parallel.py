"""Tensor parallelism with 2 gloo ranks on loopback (this process is rank 0; the other is spawned by nexttoken).

The reference for every result is the same model in one process (`nexttoken.load(path)`): greedy tokens equal,
log-probs within float tolerance (the all-reduce sums partial products in another order), seeded samples equal.
"""

from __future__ import annotations

import math

import pytest
import torch

import nexttoken
from nexttoken.errors import ModelLoadError
from nexttoken.model.parallel import Shards, TensorParallelError, parameter_bytes
from support.tensor_parallel import GREEDY, SAMPLED, assert_same







@pytest.fixture(scope="module")
def stories(shared_dir):
    return shared_dir / "models" / "stories260k"


@pytest.fixture(scope="module")
def stories_tp(stories):
    llm = nexttoken.load(stories, tensor_parallel_size=2)
    yield llm
    llm.close()


# Prompts that take every runner path: several decode rows at once, a prompt over two prefill chunks (64 tokens),
# and a second one sharing its first chunk (a prefix-cache hit, replayed on the worker).
LONG = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her " \
       "friends. One day, she saw a big red ball under a tree. She ran to it and kicked it high into the sky. Her " \
       "friend Tom laughed and"


def test_stories260k_greedy_and_sampled_equal_one_process(stories, stories_tp) -> None:
    one = nexttoken.load(stories)
    prompts = ["Once upon a time", "Tom had a dog", LONG, LONG + " she ran", "The sun"]
    assert_same(stories_tp, one, prompts, **GREEDY)
    assert_same(stories_tp, one, prompts, **SAMPLED)
    # prompt log-probs (every prompt position's logits, gathered from both vocab halves)
    a = stories_tp.generate(LONG, max_new_tokens=2, do_sample=False, prompt_logprobs=True)
    b = one.generate(LONG, max_new_tokens=2, do_sample=False, prompt_logprobs=True)
    assert a.prompt_logprobs[0] is None and len(a.prompt_logprobs) == len(b.prompt_logprobs) > 64
    assert a.prompt_logprobs[1:] == pytest.approx(b.prompt_logprobs[1:], abs=1e-4)


def test_stories260k_stream_matches(stories_tp, stories) -> None:
    one = nexttoken.load(stories)
    assert "".join(stories_tp.stream("Lily saw", max_new_tokens=20, do_sample=False)) == one.generate(
        "Lily saw", max_new_tokens=20, do_sample=False).text


def test_search_strategies_refused_clearly(stories_tp) -> None:
    with pytest.raises(TensorParallelError, match="sharded over 2 ranks"):
        stories_tp.generate("Once upon a time", max_new_tokens=4, num_beams=2, do_sample=False)
    # the ranks are still in step afterwards
    assert len(stories_tp.generate("Once", max_new_tokens=4, do_sample=False).token_ids) == 4


def test_rank_holds_half_of_the_sharded_weights(stories, stories_tp) -> None:
    """Worked out from config.json: every matrix and the embedding/head split in two, norms replicated."""
    cfg = stories_tp.model.parallel.full_config
    C, I, L, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    sharded = L * (C * (q + 2 * kv) + q * C + 3 * C * I) + V * C * (1 if cfg.tie_word_embeddings else 2)
    replicated = (2 * L + 1) * C
    assert parameter_bytes(stories_tp.model) == 4 * (sharded // 2 + replicated)
    assert parameter_bytes(nexttoken.load(stories).model) == 4 * (sharded + replicated)


def test_start_up_errors_are_clear(stories) -> None:
    with pytest.raises(ModelLoadError, match=r"tensor_parallel_size=3 does not divide num_attention_heads=8"):
        nexttoken.load(stories, tensor_parallel_size=3)
    with pytest.raises(ModelLoadError, match="tensor_parallel_size must be an integer >= 1"):
        nexttoken.load(stories, tensor_parallel_size=0)
    import dataclasses

    from nexttoken.config import ModelConfig
    from nexttoken.engine.launch import backend_for
    from nexttoken.model.parallel import check_divisible

    other = dataclasses.replace(ModelConfig.from_dir(stories), architecture="SomeOtherForCausalLM")
    with pytest.raises(ModelLoadError, match="does not split SomeOtherForCausalLM yet"):
        check_divisible(other, 2)

    with pytest.raises(ModelLoadError, match="runs on cpu or cuda, not meta"):
        backend_for(torch.device("meta"))


def test_shards_plan_kv_heads() -> None:
    from nexttoken.config import ModelConfig

    cfg = ModelConfig("LlamaForCausalLM", 100, 64, 96, 1, 8, 2, 8, 64)
    # 4 ranks over 2 KV heads: ranks 0, 1 read KV head 0; ranks 2, 3 read KV head 1
    assert [Shards.plan(cfg, r, 4).kv for r in range(4)] == [(0, 8), (0, 8), (8, 16), (8, 16)]
    assert [Shards.plan(cfg, r, 4).q for r in range(4)] == [(0, 16), (16, 32), (32, 48), (48, 64)]
    assert [Shards.plan(cfg, r, 4).vocab for r in range(4)] == [(0, 25), (25, 50), (50, 75),
                                                                                  (75, 100)]
    assert math.ceil(100 / 8) == Shards.plan(cfg, 7, 8).vocab_rows == 13 and Shards.plan(cfg, 7, 8).vocab == (91, 100)
