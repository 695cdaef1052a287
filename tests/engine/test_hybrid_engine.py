"""The engine on models whose layers keep a recurrent state (issue 41: LFM2's short convolutions, Qwen3.5's gated
delta rule): one state slot per running sequence, carried across prefill chunks. Greedy tokens identical to
transformers for a mixed batch with chunk sizes 1, 7 and 64; each request of a mixed batch gives its solo tokens,
preempted ones included (recomputed: the same tokens) and n = 2 (seeded, each sequence its solo draw; the prompt
prefilled once and the state copied at the fork); the prefix cache with the state checkpointed where a cached
prefix ends (a hit gives the bits of a miss); the features that cannot work yet refused with a message naming the
feature and the model."""

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
    decode; prefix caching on (its state checkpoints), or turned off with the log line saying so when the
    checkpoints are."""
    model, want = pair
    engine = LLMEngine(model, None, EngineConfig(max_num_seqs=4, chunk_size=chunk, max_num_batched_tokens=64))
    assert engine.blocks.prefix_caching and engine.runner.checkpoints is not None
    with caplog.at_level(logging.WARNING, logger="nexttoken.engine"):
        off = LLMEngine(model, None, EngineConfig(max_num_seqs=4, chunk_size=chunk, state_checkpoints=0))
    assert not off.blocks.prefix_caching
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
    forked = LLMEngine(model, None, EngineConfig(max_num_seqs=4, chunk_size=8))
    pairs = forked.generate([PROMPTS[2]], dataclasses.replace(sampled, num_return_sequences=2))
    assert [s.prefix_hit_tokens for s in pairs] == [0, 8]  # the second started from the first's state at 8
    assert forked.stats().prefix_hit_tokens == 8 and forked.stats().state_checkpoints == 1
    for i, seq in enumerate(pairs):
        solo = LLMEngine(model, None, EngineConfig(max_num_seqs=1)).generate(
            [PROMPTS[2]], dataclasses.replace(sampled, seed=11 + i))
        assert seq.output_ids == solo[0].output_ids


def test_a_prefix_cache_hit_gives_the_bits_of_a_miss(pair) -> None:
    """A prompt sharing 40 tokens with an earlier one starts from the state checkpointed at 40 (five chunks of 8)
    and gives the tokens and log-probs, bit for bit, of the same prompt on an engine without the prefix cache; the
    checkpoints are bounded (least recently used dropped), and a prefix whose checkpoint was dropped is a miss."""
    model, _ = pair
    shared = PROMPTS[1][:40]
    later = shared + [7, 8, 9, 60, 61, 3]
    greedy = GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=None)
    alone = LLMEngine(model, None, EngineConfig(max_num_seqs=2, chunk_size=8, enable_prefix_caching=False))
    (miss,) = alone.generate([later], greedy)
    engine = LLMEngine(model, None, EngineConfig(max_num_seqs=2, chunk_size=8, block_size=4, state_checkpoints=3))
    engine.generate([PROMPTS[1]], greedy)
    assert len(engine.runner.checkpoints) == 3  # of the 8 whole chunks, the 3 most recent (ending at 48, 56, 64)
    (dropped,) = engine.generate([later], greedy)
    assert dropped.prefix_hit_tokens == 0 and dropped.output_ids == miss.output_ids
    (hit,) = engine.generate([later], greedy)  # its own chunk at 40 was checkpointed just now
    assert hit.prefix_hit_tokens == 40
    assert hit.output_ids == miss.output_ids and hit.out.logprobs == miss.out.logprobs
    stats = engine.stats()
    assert stats.prefix_hit_tokens == 40 and stats.state_checkpoints == 3
    assert stats.state_checkpoint_bytes == 3 * state_bytes(model.config, model.dtype)


def test_state_memory_is_counted_and_checked(pair) -> None:
    model, _ = pair
    per_seq = state_bytes(model.config, model.dtype)
    assert per_seq > 0
    engine = LLMEngine(model, None, EngineConfig(max_num_seqs=3))
    assert engine.runner.states.nbytes == 3 * per_seq
    assert engine.runner.checkpoints.nbytes == 3 * per_seq  # the prefix cache's, max_num_seqs by default
    with pytest.raises(GenerationConfigError, match="recurrent state needs .* lower --max-num-seqs"):
        LLMEngine(model, None, EngineConfig(max_num_seqs=2**40 // per_seq + 1, num_kv_blocks=4))


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    """An attention-only draft model over the same vocabulary (random: most of its drafts are rejected)."""
    folder = tmp_path_factory.mktemp("draft")
    save_variant("llama-gqa", folder, seed=3)
    return load_model(folder)


def test_speculative_decoding_rolls_the_state_back_and_is_lossless(pair, draft) -> None:
    """Prompt lookup and a draft model on a hybrid: each request's rows verified one depth at a time and its state
    put back to the one after its last kept draft, so every request's greedy tokens are those of the same batch
    without speculation (one request of it does not speculate); drafts were both kept and rejected."""
    model, _ = pair
    prompts = [[1] + [5, 6, 7] * 8, [1, 9, 8, 7, 6] * 5, PROMPTS[2], PROMPTS[0], [1, 2, 3]]  # some drafts hit
    greedy = GenerationConfig(max_new_tokens=24, do_sample=False, eos_token_id=None)
    lookup = dataclasses.replace(greedy, prompt_lookup_num_tokens=3)
    want = [s.output_ids for s in LLMEngine(model, None, EngineConfig(max_num_seqs=5, chunk_size=8)).generate(
        prompts, greedy)]
    engine = LLMEngine(model, None, EngineConfig(max_num_seqs=5, chunk_size=8))
    seqs = [engine.add_request(p, lookup) for p in prompts[:3]]
    seqs += [engine.add_request(prompts[3], greedy, draft_model=draft), engine.add_request(prompts[4], greedy)]
    while engine.has_unfinished():
        engine.step()
    assert [s.output_ids for s in seqs] == want
    stats = engine.stats()
    assert 0 < stats.spec_accepted_tokens_total < stats.spec_draft_tokens_total, stats
    with pytest.raises(GenerationConfigError, match="draft model .* keep a recurrent state"):
        engine.add_request(PROMPTS[0], greedy, draft_model=model)
    with pytest.raises(GenerationConfigError, match="draft model .* keep a recurrent state"):
        LLMEngine(model, None, EngineConfig(max_num_seqs=2), speculative=SpeculativeConfig(draft_model=model))
    assert LLMEngine(model, None, EngineConfig(max_num_seqs=2), speculative=SpeculativeConfig()).speculator.default


def test_features_that_cannot_work_yet_are_refused_by_name(pair) -> None:
    model, _ = pair
    arch = model.config.architecture
    if not any(model.config.layer(i).keeps_kv for i in range(model.config.num_hidden_layers)) \
            and not model.config.intermediate_size:  # Mamba2: no attention and no MLP for an adapter to change
        with pytest.raises(LoraError, match=f"LoRA adapters are not applied to {arch}"):
            attach(model, 1, 4)
    with pytest.raises(ModelLoadError, match=f"tensor parallelism does not split {arch}"):
        check_divisible(model.config, 2)
