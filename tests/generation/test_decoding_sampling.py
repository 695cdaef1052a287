"""Sampling paths: seeded reproducibility, and empirical token frequencies that match the processed
distribution (the softmax of output_scores)."""

from __future__ import annotations

import pytest
import torch

from nexttoken.generation import generate
from support.decoding import model_pair

N = 4000


def test_seeded_sampling_is_reproducible_and_seed_dependent() -> None:
    _, ours = model_pair()
    ids = torch.tensor([[1, 5, 17, 33], [1, 40, 41, 42]])
    kw = dict(max_new_tokens=10, do_sample=True, top_k=0, eos_token_id=None)
    a, b, c = (generate(ours, ids, seed=s, **kw) for s in (4, 4, 5))
    assert torch.equal(a, b) and not torch.equal(a, c)
    beams = dict(max_new_tokens=6, do_sample=True, num_beams=3, eos_token_id=None, pad_token_id=3)
    assert torch.equal(generate(ours, ids, seed=9, **beams), generate(ours, ids, seed=9, **beams))


@pytest.mark.parametrize("options", [
    dict(temperature=1.3, top_k=0),
    dict(temperature=0.8, top_k=8, top_p=0.9),
    dict(min_p=0.05, top_k=0, presence_penalty=0.5),
    dict(typical_p=0.8, top_k=0, xtc_probability=1.0, xtc_threshold=0.02),
    dict(top_n_sigma=1.0, top_k=0),
], ids=lambda o: ",".join(o))
def test_first_token_frequencies_match_the_processed_distribution(options: dict) -> None:
    _, ours = model_pair()
    prompt = torch.tensor([[1, 5, 17, 33]])
    out = generate(ours, prompt, max_new_tokens=1, do_sample=True, num_return_sequences=N, seed=0,
                   eos_token_id=None, return_dict_in_generate=True, output_scores=True, **options)
    probs = out.scores[0][0].softmax(-1)  # every row has the same processed distribution at step 1
    if "xtc_probability" not in options:
        assert torch.allclose(out.scores[0], out.scores[0][:1].expand_as(out.scores[0]))
    freq = torch.bincount(out.sequences[:, -1], minlength=probs.shape[0]).float() / N
    # 5-sigma binomial band per token, and nothing outside the kept set
    band = 5 * (probs * (1 - probs) / N).sqrt() + 1e-3
    assert ((freq - probs).abs() <= band).all()
    assert freq[probs == 0].sum() == 0
