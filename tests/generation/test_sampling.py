"""Sampling: seeded reproducibility, agreement with the processed distribution, and with transformers' draws."""

from __future__ import annotations

import pytest
import torch

from nexttoken import generate
from nexttoken.generation.sampling import Sampler
from nexttoken.model import load_model
from support.tiny_models import save_variant


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("m")
    hf = save_variant("llama-gqa", d)
    return hf, load_model(d)


def test_same_seed_same_samples_different_seed_different(pair) -> None:
    _, model = pair
    ids = torch.tensor([[1, 5, 9], [1, 7, 3]])
    run = lambda seed: generate(model, ids, do_sample=True, seed=seed, max_new_tokens=30, eos_token_id=None)  # noqa: E731
    assert torch.equal(run(1234), run(1234))
    assert not torch.equal(run(1234), run(4321))


def test_unseeded_calls_differ(pair) -> None:
    _, model = pair
    ids = torch.tensor([[1, 5, 9]])
    outs = {tuple(generate(model, ids, do_sample=True, max_new_tokens=30, eos_token_id=None)[0].tolist())
            for _ in range(3)}
    assert len(outs) > 1


def test_seeded_samples_equal_transformers_under_the_same_seed(pair) -> None:
    """Both draw with torch.multinomial; our generator seeded with s draws what torch.manual_seed(s) gives."""
    hf, model = pair
    ids = torch.tensor([[0, 1, 5, 9], [1, 7, 3, 4]])
    mask = (ids != 0).long()
    kwargs = dict(do_sample=True, temperature=0.9, top_k=20, top_p=0.95, max_new_tokens=25, eos_token_id=2,
                  pad_token_id=0)
    torch.manual_seed(77)
    expected = hf.generate(input_ids=ids, attention_mask=mask, **kwargs)
    got = generate(model, ids, attention_mask=mask, seed=77, **kwargs)
    assert torch.equal(got, expected)


def test_empirical_distribution_matches_processed_scores(pair) -> None:
    """4000 draws of one step: chi-square against softmax(processed scores), and nothing outside top_k."""
    _, model = pair
    n = 4000
    ids = torch.tensor([[1, 5, 9, 14]]).repeat(n, 1)
    out = generate(model, ids, do_sample=True, temperature=1.3, top_k=8, seed=5, max_new_tokens=1,
                   eos_token_id=None, output_scores=True, return_dict_in_generate=True)
    probs = out.scores[0][0].softmax(-1)
    allowed = probs > 0
    assert int(allowed.sum()) == 8
    counts = torch.bincount(out.sequences[:, -1], minlength=probs.numel()).double()
    assert counts[~allowed].sum() == 0, "sampled a token that top_k removed"
    expected = probs[allowed].double() * n
    chi2 = float(((counts[allowed] - expected) ** 2 / expected).sum())
    assert chi2 < 24.32, f"chi-square {chi2:.1f} over the 0.1% critical value for 7 degrees of freedom"


def test_sampler_hand_made_distribution() -> None:
    """A known distribution, no model: frequencies within 4 standard errors of the target."""
    target = torch.tensor([0.5, 0.25, 0.125, 0.125, 0.0])
    scores = target.log().repeat(20000, 1)
    draws = Sampler(greedy=False, seed=0)(scores)
    freq = torch.bincount(draws, minlength=5).double() / len(draws)
    stderr = (target * (1 - target) / len(draws)).sqrt().double()
    assert freq[4] == 0
    assert ((freq - target.double()).abs() <= 4 * stderr + 1e-12).all(), freq


def test_greedy_sampler_is_argmax() -> None:
    scores = torch.tensor([[0.1, 3.0, -1.0], [5.0, 4.0, 4.9]])
    assert Sampler(greedy=True)(scores).tolist() == [1, 0]


def test_temperature_zero_means_greedy(pair) -> None:
    _, model = pair
    ids = torch.tensor([[1, 5, 9]])
    greedy = generate(model, ids, max_new_tokens=15, eos_token_id=None)
    assert torch.equal(generate(model, ids, do_sample=True, temperature=0.0, max_new_tokens=15, eos_token_id=None),
                       greedy)
