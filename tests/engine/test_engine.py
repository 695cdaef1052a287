"""The continuous-batching engine, in process: results equal an independent reference (transformers, the Python
API's own decode loop), alone or batched, with chunked prefill, prefix caching, bounded slots and cancellation."""

from __future__ import annotations

import pytest
import torch

import nexttoken
from nexttoken.engine import EngineConfig, LLMEngine
from nexttoken.errors import GenerationConfigError, PromptTooLongError
from nexttoken.generation.config import GenerationConfig
from nexttoken.model import load_model

from support.tiny_models import save_variant

GREEDY = GenerationConfig(eos_token_id=2, top_k=None)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def stories(shared_dir):
    return nexttoken.load(shared_dir / "models" / "stories260k")


def _run(engine: LLMEngine, prompts: list[list[int]], params: list[GenerationConfig]) -> list:
    """Requests with options of their own, run to completion together."""
    seqs = [engine.add_request(p, c) for p, c in zip(prompts, params)]
    while engine.has_unfinished():
        engine.step()
    return seqs


def _engine(llm, **config) -> LLMEngine:
    return LLMEngine(llm.model, llm.tokenizer, EngineConfig(**{"chunk_size": 16, "max_num_seqs": 8, **config}))


PROMPTS = [
    "Once upon a time",
    "Lily went to the park",
    "Tom had a big red ball and he liked to play with it every day. One day he saw a dog in the garden and",
    "The sun",
]


@pytest.mark.parametrize("variant", ["llama-gqa", "mistral-sliding"])
def test_greedy_equals_transformers_per_prompt(tmp_path, variant) -> None:
    """Random-weight models: every row of a batch (chunked prefill included) equals transformers on that prompt."""
    hf = save_variant(variant, tmp_path)
    model = load_model(tmp_path)
    engine = LLMEngine(model, None, EngineConfig(chunk_size=8, max_num_seqs=4, max_num_batched_tokens=24))
    prompts = [[1, 5, 9, 22], [1] + list(range(10, 40)), [1, 7], [1, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59]]
    params = GENERATION_NO_EOS.updated(max_new_tokens=12)
    seqs = engine.generate(prompts, params)
    for prompt, seq in zip(prompts, seqs):
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(prompt):].tolist()
        assert seq.output_ids == expected, prompt
        assert seq.finish_reason == "length"


GENERATION_NO_EOS = GenerationConfig(eos_token_id=None, top_k=None)


def test_greedy_same_alone_batched_and_python_api(stories) -> None:
    engine = _engine(stories)
    params = GREEDY.updated(max_new_tokens=40)
    ids = [stories.encode(p) for p in PROMPTS]
    batched = engine.generate(ids, params)
    for prompt, p_ids, seq in zip(PROMPTS, ids, batched):
        alone = engine.generate([p_ids], params)[0]
        assert alone.output_ids == seq.output_ids
        # The padded-batch decode loop, an independent path: same ids, and text and log-probs from them.
        reference = nexttoken.generate(stories.model, torch.tensor([p_ids]), max_new_tokens=40,
                                       return_dict_in_generate=True, top_k=None, eos_token_id=2)
        new = reference.sequences[0, len(p_ids):].tolist()
        cut = new.index(2) + 1 if 2 in new else len(new)
        assert seq.output_ids == new[:cut]
        head = stories.tokenizer.decode(p_ids, skip_special_tokens=True)  # the text continues the prompt's
        assert head + seq.out.text == stories.tokenizer.decode(p_ids + new[:cut], skip_special_tokens=True)
        assert seq.out.logprobs == pytest.approx(reference.logprobs[0, :cut].tolist(), abs=1e-4)


def test_seeded_samples_do_not_depend_on_batch_mates(stories) -> None:
    engine = _engine(stories)
    sampled = GREEDY.updated(do_sample=True, temperature=1.3, seed=7).updated(max_new_tokens=30)
    ids = [stories.encode(p) for p in PROMPTS]
    alone = engine.generate([ids[0]], sampled)[0].output_ids
    greedy = GREEDY.updated(max_new_tokens=30)
    mixed = _run(engine, ids, [sampled, greedy, GREEDY.updated(do_sample=True, seed=99, max_new_tokens=30), greedy])
    assert mixed[0].output_ids == alone
    other_seed = GREEDY.updated(do_sample=True, temperature=1.3, seed=8).updated(max_new_tokens=30)
    assert engine.generate([ids[0]], other_seed)[0].output_ids != alone


def test_prefix_cache_hits_and_changes_nothing(stories) -> None:
    engine = _engine(stories)
    shared = stories.encode(PROMPTS[2] + " " + PROMPTS[2])
    assert len(shared) > 48
    params = GREEDY.updated(max_new_tokens=20)
    first = engine.generate([shared + [400]], params)[0]
    hits_before = engine.blocks.hit_tokens
    second = engine.generate([shared + [401]], params)[0]
    assert engine.blocks.hit_tokens - hits_before == (len(shared) // 16) * 16 > 0
    assert second.prefix_hit_tokens > 0
    no_cache = _engine(stories, enable_prefix_caching=False).generate([shared + [401]], params)[0]
    assert second.output_ids == no_cache.output_ids
    assert first.output_ids == _engine(stories, enable_prefix_caching=False).generate([shared + [400]], params)[0].output_ids


def test_slots_bound_the_batch_and_waiting_requests_run_later(stories) -> None:
    engine = _engine(stories, max_num_seqs=2)
    params = GREEDY.updated(max_new_tokens=10)
    for p in PROMPTS:
        engine.add_request(stories.encode(p), params)
    most = 0
    while engine.has_unfinished():
        engine.step()
        stats = engine.stats()
        most = max(most, stats.num_running)
        assert stats.num_running + stats.num_waiting <= len(PROMPTS)
    assert most == 2
    assert engine.stats().generated_tokens_total == 10 * len(PROMPTS)


def test_abort_frees_the_slot_at_the_next_step(stories) -> None:
    engine = _engine(stories, max_num_seqs=1)
    params = GREEDY.updated(max_new_tokens=200, ignore_eos=True)
    engine.add_request(stories.encode(PROMPTS[0]), params, request_id="long")
    engine.add_request(stories.encode(PROMPTS[1]), GREEDY.updated(max_new_tokens=5), request_id="next")
    for _ in range(3):
        engine.step()
    assert engine.stats().num_waiting == 1
    final = engine.abort("long")
    assert final is not None and final.finish_reason == "abort"
    events = engine.step()
    assert engine.stats().num_running == 1 and engine.stats().num_waiting == 0
    assert [e.request_id for e in events] == ["next"]


def test_bad_requests_raise_typed_errors(stories) -> None:
    engine = _engine(stories, max_model_len=64)
    with pytest.raises(PromptTooLongError):
        engine.add_request(list(range(3, 70)), GREEDY)
    with pytest.raises(GenerationConfigError):
        engine.add_request([1, 999999], GREEDY)
    with pytest.raises(GenerationConfigError, match="one greedy or sampled sequence"):
        engine.add_request([1, 5], GREEDY.updated(num_beams=2))
    with pytest.raises(GenerationConfigError, match="output_scores"):
        engine.add_request([1, 5], GREEDY.updated(output_scores=True))


def test_greedy_identical_for_any_batch_size(stories) -> None:
    """20 requests (more than one decode forward's rows) give each request's greedy ids bit for bit as alone."""
    engine = _engine(stories, max_num_seqs=24)
    words = "the cat dog girl boy sun ball tree ran saw big red happy park".split()
    prompts = [stories.encode(" ".join(words[i % 14 : i % 14 + 2 + i % 5])) for i in range(20)]
    params = GREEDY.updated(max_new_tokens=24, ignore_eos=True)
    together = engine.generate(prompts, params)
    for prompt, seq in zip(prompts, together):
        alone = engine.generate([prompt], params)[0]
        assert alone.output_ids == seq.output_ids
        assert alone.out.logprobs == seq.out.logprobs  # the very same numbers, not merely the same argmax


def test_a_request_failing_at_run_time_ends_alone(stories) -> None:
    engine = _engine(stories)
    with pytest.raises(GenerationConfigError, match="logit_bias names token ids \\[100000\\] outside"):
        engine.add_request(stories.encode("A"), GREEDY.updated(logit_bias={100000: 5.0}))  # refused up front
    # Sampling with every token but one suppressed, which no_repeat_ngram_size=1 bans once written: valid options,
    # nothing left to sample from when it runs (suppressing every token outright is refused up front).
    vocab = stories.model.config.vocab_size
    bad = GREEDY.updated(do_sample=True, suppress_tokens=[i for i in range(vocab) if i != 5], no_repeat_ngram_size=1,
                         max_new_tokens=5)
    good = GREEDY.updated(max_new_tokens=5)
    failed, served = _run(engine, [stories.encode("A"), stories.encode("B")], [bad, good])
    assert failed.finish_reason == "error" and "probability tensor" in failed.out.stop_reason
    assert served.finish_reason == "length" and len(served.output_ids) == 5
    assert not engine.has_unfinished() and engine.stats().num_running == 0


def test_long_prompt_prefills_in_chunks_while_others_keep_decoding(stories) -> None:
    engine = _engine(stories, max_num_batched_tokens=20)  # room for one 16-token chunk per step
    engine.add_request(stories.encode("Once upon a time"), GREEDY.updated(max_new_tokens=50,
                                                                          ignore_eos=True), request_id="running")
    for _ in range(3):
        engine.step()
    long_prompt = stories.encode(" ".join([PROMPTS[2]] * 4))
    assert len(long_prompt) > 100
    long = engine.add_request(long_prompt, GREEDY.updated(max_new_tokens=3), request_id="long")
    steps_to_first_token = 0
    while not long.output_ids:
        events = engine.step()
        steps_to_first_token += 1
        assert [e.request_id for e in events if e.token_ids][:1] == ["running"]  # a token every step
    assert steps_to_first_token == -(-len(long_prompt) // 16)  # one chunk per step
