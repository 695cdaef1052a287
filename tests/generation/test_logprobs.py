"""Per-token logprobs with top-N alternatives and prompt logprobs, against transformers' logits."""

from __future__ import annotations

import torch

from nexttoken.generation import generate
from support.decoding import PROMPTS, left_padded, model_pair


def test_token_logprobs_and_top_alternatives_match_transformers() -> None:
    hf, ours = model_pair()
    ids, mask = left_padded(PROMPTS)
    kw = dict(max_new_tokens=6, eos_token_id=2, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    expected = hf.generate(input_ids=ids, attention_mask=mask, **kw)
    got = generate(ours, ids, attention_mask=mask, top_logprobs=5, **kw)
    assert torch.equal(got.sequences, expected.sequences)
    want = hf.compute_transition_scores(expected.sequences, expected.logits, normalize_logits=True)
    torch.testing.assert_close(got.logprobs, want, rtol=1e-4, atol=1e-4)
    raw = torch.stack(expected.logits, dim=1).float().log_softmax(-1)  # (B, T, V)
    top = raw.topk(5, dim=-1)
    torch.testing.assert_close(got.top_logprobs, top.values, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.top_logprob_ids, top.indices)
    assert (got.top_logprobs[..., :1] >= got.logprobs[..., None] - 1e-6).all()  # greedy: the chosen is the best


@torch.no_grad()
def test_prompt_logprobs_match_a_transformers_forward() -> None:
    hf, ours = model_pair()
    ids, mask = left_padded(PROMPTS)
    got = generate(ours, ids, attention_mask=mask, max_new_tokens=1, prompt_logprobs=True, return_dict_in_generate=True)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    logits = hf(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()
    want = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # (B, P-1)
    have = got.prompt_logprobs
    assert have.shape == ids.shape
    real = mask[:, 1:].bool() & mask[:, :-1].bool()  # a token with a real token before it
    assert torch.isnan(have[:, 0]).all() and torch.equal(torch.isnan(have[:, 1:]), ~real)
    torch.testing.assert_close(have[:, 1:][real], want[real], rtol=1e-4, atol=1e-4)


def test_logprobs_with_sampling_are_of_the_raw_distribution() -> None:
    _, ours = model_pair()
    ids, mask = left_padded(PROMPTS)
    out = generate(ours, ids, attention_mask=mask, max_new_tokens=4, do_sample=True, temperature=0.5, seed=3,
                   top_logprobs=2, output_logits=True, return_dict_in_generate=True)
    new = out.sequences[:, ids.shape[1]:]
    for t, logits in enumerate(out.logits):
        torch.testing.assert_close(out.logprobs[:, t], logits.log_softmax(-1).gather(1, new[:, t : t + 1]).squeeze(1))


def test_llm_completion_top_logprobs_prompt_logprobs_and_echo(tmp_path) -> None:  # noqa: ANN001
    import math

    import nexttoken
    from support.tiny_models import save_variant

    save_variant("llama-gqa", tmp_path)
    llm = nexttoken.load(tmp_path)
    prompt = [1, 5, 17, 33]
    low = generate(llm.model, torch.tensor([prompt]), max_new_tokens=4, top_logprobs=3, prompt_logprobs=True,
                   return_dict_in_generate=True)
    c = llm.generate(prompt, max_new_tokens=4, top_logprobs=3, prompt_logprobs=True)
    assert c.token_ids == low.sequences[0, 4:].tolist()
    assert c.top_logprobs is not None and len(c.top_logprobs) == 4 and all(len(t) == 3 for t in c.top_logprobs)
    assert list(c.top_logprobs[0]) == low.top_logprob_ids[0, 0].tolist()
    assert c.prompt_logprobs is not None and c.prompt_logprobs[0] is None
    torch.testing.assert_close(torch.tensor(c.prompt_logprobs[1:]), low.prompt_logprobs[0, 1:])
    echoed = llm.generate(prompt, max_new_tokens=4, echo=True)  # llama3 reference: prompt ids and logprobs lead
    assert echoed.token_ids == prompt + c.token_ids
    assert math.isnan(echoed.logprobs[0]) and echoed.logprobs[1:4] == c.prompt_logprobs[1:]
    assert echoed.logprobs[4:] == c.logprobs


def test_llm_beam_search_returns_num_return_sequences(tmp_path) -> None:  # noqa: ANN001
    import nexttoken
    from support.tiny_models import save_variant

    save_variant("llama-gqa", tmp_path)
    llm = nexttoken.load(tmp_path)
    prompt = [1, 5, 17, 33]
    out = generate(llm.model, torch.tensor([prompt]), max_new_tokens=5, num_beams=3, num_return_sequences=2,
                   eos_token_id=None, pad_token_id=0)
    got = llm.generate(prompt, max_new_tokens=5, num_beams=3, num_return_sequences=2, eos_token_id=None)
    assert [c.token_ids for c in got] == out[:, 4:].tolist()


def test_generate_frees_each_steps_scores_unless_asked_to_keep_them() -> None:
    """Holding every step's (B, V) scores during generation would grow memory by steps x B x V floats; only
    output_scores keeps them (checked while generating: after it returns, everything is freed either way)."""
    import gc
    import weakref

    _, model = model_pair()
    ids, mask = left_padded(PROMPTS)
    for keep in (False, True):
        seen: list[weakref.ref] = []
        alive_before: list[int] = []

        def watch(input_ids, scores):  # noqa: ANN001, ANN202
            gc.collect()
            alive_before.append(sum(ref() is not None for ref in seen))  # earlier steps' scores still held
            seen.append(weakref.ref(scores))
            return scores

        # gc.freeze: the collections in `watch` look only at objects made from here on (each step's scores),
        # not at the whole heap of torch and transformers, which made each one take ~0.5 s
        gc.freeze()
        try:
            out = generate(model, ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None,
                           logits_processor=[watch], return_dict_in_generate=True, output_scores=keep, top_logprobs=2)
        finally:
            gc.unfreeze()
        if keep:
            assert alive_before[-1] == 11, alive_before
        else:  # at most the step just before (still referenced by the loop)
            assert max(alive_before) <= 1, alive_before
        assert out.logprobs.shape == (3, 12) and out.top_logprobs.shape == (3, 12, 2)
