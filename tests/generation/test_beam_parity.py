"""Beam search and beam sampling against transformers' generate: sequences, sequences_scores, beam_indices and
per-step scores, batched with left padding, over num_beams / length_penalty / early_stopping /
num_return_sequences combinations; compute_transition_scores; the cache reorder."""

from __future__ import annotations

import pytest
import torch

from nexttoken.generation import generate
from nexttoken.generation.logprobs import compute_transition_scores
from nexttoken.model import KVCache
from support.decoding import PROMPTS, left_padded, model_pair

# EOS ids the random model actually produces (43, 8), so hypotheses finish at different lengths.
COMBOS = [
    dict(num_beams=3, eos_token_id=2),
    dict(num_beams=4, num_return_sequences=2, length_penalty=0.5, early_stopping=True, eos_token_id=[2, 43]),
    dict(num_beams=2, early_stopping="never", length_penalty=2.0, eos_token_id=[2, 8]),
    dict(num_beams=3, num_return_sequences=3, length_penalty=-1.0, eos_token_id=[2, 43, 8]),
    dict(num_beams=4, length_penalty=0.0, early_stopping="never", eos_token_id=[43], num_return_sequences=4),
    dict(num_beams=3, early_stopping=True, eos_token_id=[8, 50], repetition_penalty=1.3, no_repeat_ngram_size=3),
    dict(num_beams=3, do_sample=True, num_return_sequences=2, top_k=20, eos_token_id=[2, 43]),
    dict(num_beams=2, do_sample=True, temperature=0.8, early_stopping=True, eos_token_id=[2, 8], top_k=0),
    dict(num_beams=4, do_sample=True, top_p=0.9, length_penalty=1.5, early_stopping="never", eos_token_id=[43, 8]),
]


def _run_both(variant: str, options: dict, seed: int = 7):  # noqa: ANN202
    hf, ours = model_pair(variant)
    ids, mask = left_padded(PROMPTS)
    # pad_token_id 3 (not 0): transformers fills finished beams with `pad_token_id or eos`, so 0 would read as EOS.
    common = dict(max_new_tokens=10, pad_token_id=3, return_dict_in_generate=True, output_scores=True, **options)
    torch.manual_seed(seed)
    expected = hf.generate(input_ids=ids, attention_mask=mask, **common)
    got = generate(ours, ids, attention_mask=mask, seed=seed, **common)
    return expected, got


@pytest.mark.parametrize("options", COMBOS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_beam_outputs_match_transformers(options: dict) -> None:
    expected, got = _run_both("llama-gqa", options)
    assert torch.equal(got.sequences, expected.sequences)
    assert torch.equal(got.beam_indices, expected.beam_indices.long())
    torch.testing.assert_close(got.sequences_scores, expected.sequences_scores, rtol=1e-4, atol=1e-4)
    assert len(got.scores) == len(expected.scores)
    for have, want in zip(got.scores, expected.scores):
        assert torch.equal(torch.isneginf(have), torch.isneginf(want))
        torch.testing.assert_close(have[want.isfinite()], want[want.isfinite()], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("variant", ["qwen2-bias", "mistral-sliding"])
def test_beam_search_other_architectures(variant: str) -> None:
    expected, got = _run_both(variant, dict(num_beams=3, num_return_sequences=2, eos_token_id=[2, 43, 8]))
    assert torch.equal(got.sequences, expected.sequences)
    torch.testing.assert_close(got.sequences_scores, expected.sequences_scores, rtol=1e-4, atol=1e-4)


def test_transition_scores_rebuild_sequences_scores() -> None:
    hf, _ = model_pair("llama-gqa")
    options = dict(num_beams=4, num_return_sequences=2, length_penalty=0.7, eos_token_id=[2, 43])
    expected, got = _run_both("llama-gqa", options)
    ours = compute_transition_scores(got.sequences, got.scores, got.beam_indices)
    theirs = hf.compute_transition_scores(expected.sequences, expected.scores, expected.beam_indices)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    length = (got.beam_indices >= 0).sum(dim=1)
    torch.testing.assert_close(ours.sum(dim=1) / length**0.7, got.sequences_scores, rtol=1e-4, atol=1e-4)


def test_transition_scores_for_greedy_and_sampling() -> None:
    hf, ours = model_pair("llama-gqa")
    ids, mask = left_padded(PROMPTS)
    for kw in (dict(do_sample=False), dict(do_sample=True, top_k=10)):
        out = generate(ours, ids, attention_mask=mask, max_new_tokens=5, return_dict_in_generate=True,
                       output_scores=True, seed=1, **kw)
        for normalize in (False, True):
            mine = compute_transition_scores(out.sequences, out.scores, normalize_logits=normalize)
            ref = hf.compute_transition_scores(out.sequences, out.scores, normalize_logits=normalize)
            torch.testing.assert_close(mine, ref)


def test_cache_reorder_copies_only_the_given_columns() -> None:
    cache = KVCache(2, 4, 2, 10, 3, torch.float32, "cpu")
    torch.manual_seed(0)
    cache.k.normal_()
    cache.v.normal_()
    before_k, before_v = cache.k.clone(), cache.v.clone()
    rows = torch.tensor([2, 2, 0, 1])
    cache.reorder(rows, 4, 7)
    assert torch.equal(cache.k[:, :, :, 4:7], before_k[:, rows, :, 4:7])
    assert torch.equal(cache.v[:, :, :, 4:7], before_v[:, rows, :, 4:7])
    assert torch.equal(cache.k[:, :, :, :4], before_k[:, :, :, :4]) and torch.equal(cache.k[:, :, :, 7:], before_k[:, :, :, 7:])


def test_beam_errors_are_typed() -> None:
    _, ours = model_pair()
    ids = torch.tensor([[1, 5, 6]])
    with pytest.raises(ValueError, match="num_return_sequences"):
        generate(ours, ids, num_beams=2, num_return_sequences=3)
    with pytest.raises(ValueError, match="needs sampling"):
        generate(ours, ids, num_return_sequences=2)


def test_beam_search_reorders_only_generated_columns(monkeypatch) -> None:  # noqa: ANN001
    _, ours = model_pair()
    ids, mask = left_padded(PROMPTS)
    spans: list[tuple[int, int]] = []
    original = KVCache.reorder

    def recording(self, rows, start, end):  # noqa: ANN001, ANN202
        spans.append((start, end))
        return original(self, rows, start, end)

    monkeypatch.setattr(KVCache, "reorder", recording)
    generate(ours, ids, attention_mask=mask, num_beams=3, max_new_tokens=5, eos_token_id=None, pad_token_id=3)
    P = ids.shape[1]
    assert spans == [(P, P + step) for step in range(5)]  # the prompt columns are never copied
