"""Every processor option against transformers' generate on the same random weights: the processed scores of
each step (float tolerance, identical -inf mask) and the chosen tokens, greedy and seeded sampling."""

from __future__ import annotations

import pytest
import torch

from nexttoken.generation import generate
from support.decoding import PROMPTS, left_padded, model_pair

STEPS = 4


def _allowed(batch_id: int, ids: torch.Tensor) -> list[int]:
    return list(range(10 + batch_id, 60, 3))


# (id, options, extra generate() arguments). Greedy settings test the deterministic processors; sampled ones run
# with the same seed on both sides, so tokens match too (torch.multinomial on identically seeded generators).
SETTINGS = [
    ("repetition_penalty", dict(repetition_penalty=1.3), {}),
    ("repetition_penalty<1", dict(repetition_penalty=0.7), {}),
    ("encoder_repetition_penalty", dict(encoder_repetition_penalty=1.6), {}),
    ("no_repeat_ngram_size", dict(no_repeat_ngram_size=2, repetition_penalty=0.5), {}),
    ("encoder_no_repeat_ngram_size", dict(encoder_no_repeat_ngram_size=1), {}),
    ("bad_words_ids", dict(bad_words_ids=[[17], [2], [33, 40], [5, 17, 33, 8]]), {}),
    ("sequence_bias", dict(sequence_bias=[[[33], -3.0], [[17, 33], 4.0], [[47, 5], 2.5]]), {}),
    ("min_length", dict(min_length=12, eos_token_id=[2, 7]), {}),
    ("min_new_tokens", dict(min_new_tokens=3, eos_token_id=[2, 7]), {}),
    ("prefix_allowed_tokens_fn", {}, dict(prefix_allowed_tokens_fn=_allowed)),
    ("forced_eos_token_id", dict(forced_eos_token_id=[5, 6]), {}),
    ("remove_invalid_values", dict(remove_invalid_values=True, suppress_tokens=[3]), {}),
    ("exponential_decay_length_penalty", dict(exponential_decay_length_penalty=(1, 1.8), eos_token_id=[2, 9]), {}),
    ("suppress_tokens", dict(suppress_tokens=[5, 17, 40]), {}),
    ("begin_suppress_tokens", dict(begin_suppress_tokens=[5, 17, 40]), {}),
    ("guidance_scale", dict(guidance_scale=1.7), {}),
    ("guidance_negative_prompt", dict(guidance_scale=2.5), dict(negative_prompt_ids=torch.tensor([[1, 4], [1, 9], [1, 30]]))),
    ("renormalize_logits", dict(renormalize_logits=True, repetition_penalty=1.2), {}),
    ("watermark_lefthash", dict(watermarking_config=dict(bias=2.5, greenlist_ratio=0.3)), {}),
    ("watermark_selfhash", dict(watermarking_config=dict(seeding_scheme="selfhash", context_width=2)), {}),
    ("temperature", dict(do_sample=True, temperature=0.7, top_k=0), {}),
    ("top_k_default_50", dict(do_sample=True, temperature=3.0), {}),
    ("top_k", dict(do_sample=True, top_k=7), {}),
    ("top_p", dict(do_sample=True, top_p=0.6, top_k=0), {}),
    ("min_p", dict(do_sample=True, min_p=0.2, top_k=0), {}),
    ("top_h", dict(do_sample=True, top_h=0.4, top_k=0), {}),
    ("typical_p", dict(do_sample=True, typical_p=0.5, top_k=0), {}),
    ("epsilon_cutoff", dict(do_sample=True, epsilon_cutoff=0.02, top_k=0), {}),
    ("eta_cutoff", dict(do_sample=True, eta_cutoff=0.01, top_k=0), {}),
    ("all_warpers", dict(do_sample=True, temperature=1.4, top_h=0.9, top_k=30, top_p=0.95, min_p=0.01,
                         typical_p=0.95, epsilon_cutoff=0.001, eta_cutoff=0.001), {}),
    ("sample_with_penalties", dict(do_sample=True, repetition_penalty=1.2, no_repeat_ngram_size=2,
                                   min_new_tokens=2, renormalize_logits=True, top_k=20), {}),
    ("sample_watermark", dict(do_sample=True, watermarking_config={}, top_p=0.9), {}),
    ("num_return_sequences", dict(do_sample=True, num_return_sequences=3, top_k=10), {}),
]


@pytest.mark.parametrize("name,options,extra", SETTINGS, ids=[s[0] for s in SETTINGS])
def test_scores_and_tokens_match_transformers(name: str, options: dict, extra: dict) -> None:
    hf, ours = model_pair()
    ids, mask = left_padded(PROMPTS)
    common = dict(max_new_tokens=STEPS, output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    common = {"eos_token_id": 2, **common, **options}
    torch.manual_seed(11)
    expected = hf.generate(input_ids=ids, attention_mask=mask, **common, **extra)
    got = generate(ours, ids, attention_mask=mask, seed=11, **common, **extra)
    assert len(got.scores) == len(expected.scores)
    for step, (have, want) in enumerate(zip(got.scores, expected.scores)):
        assert torch.equal(torch.isneginf(have), torch.isneginf(want)), f"step {step}: different tokens filtered"
        finite = torch.isfinite(want)
        torch.testing.assert_close(have[finite], want[finite], rtol=1e-4, atol=1e-4)
    assert torch.equal(got.sequences, expected.sequences)


def test_forced_bos_on_a_one_token_prompt() -> None:
    hf, ours = model_pair()
    ids = torch.tensor([[1], [4]])
    common = dict(max_new_tokens=3, forced_bos_token_id=9, output_scores=True, return_dict_in_generate=True,
                  eos_token_id=2, pad_token_id=0)
    expected = hf.generate(input_ids=ids, **common)
    got = generate(ours, ids, **common)
    assert torch.equal(got.sequences, expected.sequences) and got.sequences[0, 1] == 9
    for have, want in zip(got.scores, expected.scores):
        assert torch.equal(torch.isneginf(have), torch.isneginf(want))
        torch.testing.assert_close(have[want.isfinite()], want[want.isfinite()], rtol=1e-4, atol=1e-4)


def test_greedy_long_run_with_deterministic_processors_is_token_identical() -> None:
    hf, ours = model_pair("qwen2-bias")
    ids, mask = left_padded(PROMPTS)
    options = dict(max_new_tokens=24, repetition_penalty=1.2, no_repeat_ngram_size=3, encoder_repetition_penalty=1.1,
                   bad_words_ids=[[3, 3]], sequence_bias=[[[8], -1.0]], min_new_tokens=5, suppress_tokens=[0],
                   begin_suppress_tokens=[12], exponential_decay_length_penalty=(10, 1.2),
                   eos_token_id=2, pad_token_id=0)
    expected = hf.generate(input_ids=ids, attention_mask=mask, **options)
    got = generate(ours, ids, attention_mask=mask, **options)
    assert torch.equal(got, expected)
