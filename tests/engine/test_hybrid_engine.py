"""The engine on models whose layers keep a recurrent state (issue 41: LFM2's short convolutions, Qwen3.5's gated
delta rule): one state slot per running sequence, carried across prefill chunks. Greedy tokens identical to
transformers for a mixed batch with chunk sizes 1, 7 and 64; each request of a mixed batch gives its solo tokens,
preempted ones included (recomputed: the same tokens) and n = 2 (seeded, each sequence its solo draw); the features
that cannot work yet refused with a message naming the feature and the model, prefix caching turned off with a
log line."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from nexttoken.engine import EngineConfig, LLMEngine
from nexttoken.engine.speculation import SpeculativeConfig
from nexttoken.errors import GenerationConfigError, LoraError, ModelLoadError
from nexttoken.generation.config import GenerationConfig
from nexttoken.model import load_model
from nexttoken.model.lora.registry import attach
from nexttoken.model.parallel import check_divisible
from nexttoken.model.recurrent import state_bytes
from support.tiny_models import HYBRID_FAMILIES, RECURRENT, save_variant

PROMPTS = [[1, 5, 17, 33], [1] + [(5 * i + 2) % 95 + 1 for i in range(69)], [1, 90, 3, 3, 8, 12, 7, 40, 41, 42, 9]]
NEW = 8


@pytest.fixture(scope="module", params=sorted(RECURRENT - HYBRID_FAMILIES))
def pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = save_variant(request.param, folder)
    model = load_model(folder)
    want = [hf.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                        pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
    return model, want


def _greedy() -> GenerationConfig:
    return GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=None)


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_mixed_batch_greedy_equals_transformers(pair, chunk: int, caplog) -> None:
    """Three requests of 4, 70 and 11 tokens at once, their prompts prefilled in chunks of `chunk` while the others
    decode; prefix caching asked for and turned off, with the log line saying so."""
    model, want = pair
    with caplog.at_level(logging.WARNING, logger="nexttoken.engine"):
        engine = LLMEngine(model, None, EngineConfig(max_num_seqs=4, chunk_size=chunk, max_num_batched_tokens=64))
    assert not engine.blocks.prefix_caching
    assert f"prefix caching is off for this model ({model.config.architecture})" in caplog.text
    assert engine.runner.states is not None and len(engine.runner.states.tensors) == sum(
        not model.config.layer(i).keeps_kv for i in range(model.config.num_hidden_layers))
    seqs = engine.generate(PROMPTS, _greedy())
    assert [s.output_ids for s in seqs] == want


def test_preempted_requests_and_n2_give_their_solo_tokens(pair) -> None:
    """A pool too small for all three: some are preempted, recomputed and give the tokens transformers gives;
    n = 2 seeded sampling gives each sequence the draw of its seed alone."""
    model, want = pair
    engine = LLMEngine(model, None, EngineConfig(max_num_seqs=3, chunk_size=16, block_size=4, num_kv_blocks=23))
    seqs = engine.generate(PROMPTS, _greedy())
    assert engine.scheduler.num_preemptions > 0
    assert [s.output_ids for s in seqs] == want
    sampled = GenerationConfig(max_new_tokens=NEW, do_sample=True, temperature=0.9, top_k=20, eos_token_id=None,
                               seed=11)
    pairs = LLMEngine(model, None, EngineConfig(max_num_seqs=4, chunk_size=8)).generate(
        [PROMPTS[2]], dataclasses.replace(sampled, num_return_sequences=2))
    for i, seq in enumerate(pairs):
        solo = LLMEngine(model, None, EngineConfig(max_num_seqs=1)).generate(
            [PROMPTS[2]], dataclasses.replace(sampled, seed=11 + i))
        assert seq.output_ids == solo[0].output_ids


def test_state_memory_is_counted_and_checked(pair) -> None:
    model, _ = pair
    per_seq = state_bytes(model.config, model.dtype)
    assert per_seq > 0
    engine = LLMEngine(model, None, EngineConfig(max_num_seqs=3))
    assert engine.runner.states.nbytes == 3 * per_seq
    with pytest.raises(GenerationConfigError, match="recurrent state needs .* lower --max-num-seqs"):
        LLMEngine(model, None, EngineConfig(max_num_seqs=2**40 // per_seq + 1, num_kv_blocks=4))


def test_features_that_cannot_work_yet_are_refused_by_name(pair) -> None:
    model, _ = pair
    arch = model.config.architecture
    engine = LLMEngine(model, None, EngineConfig(max_num_seqs=2))
    lookup = GenerationConfig(max_new_tokens=4, do_sample=False, prompt_lookup_num_tokens=2)
    with pytest.raises(GenerationConfigError, match=f"speculative decoding .* is not supported for {arch}"):
        engine.add_request(PROMPTS[0], lookup)
    with pytest.raises(GenerationConfigError, match=f"speculative decoding is not supported for {arch}"):
        LLMEngine(model, None, EngineConfig(max_num_seqs=2), speculative=SpeculativeConfig())
    with pytest.raises(LoraError, match=f"LoRA adapters are not applied to {arch}"):
        attach(model, 1, 4)
    with pytest.raises(ModelLoadError, match=f"tensor parallelism does not split {arch}"):
        check_divisible(model.config, 2)
