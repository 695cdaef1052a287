"""Continuing a generation from its returned cache: a second turn that reads only the new tokens gives what a
generation over the whole conversation gives (and what transformers gives)."""

from __future__ import annotations

import pytest
import torch

from nexttoken.errors import GenerationConfigError
from nexttoken.generation import generate
from support.decoding import PROMPTS, left_padded, model_pair
from support.bigram import BigramModel


def test_second_turn_from_cache_equals_from_scratch_and_transformers() -> None:
    hf, ours = model_pair()
    ids, mask = left_padded(PROMPTS)
    first = generate(ours, ids, attention_mask=mask, max_new_tokens=5, eos_token_id=None, pad_token_id=0,
                     return_dict_in_generate=True)
    turn2 = torch.cat([first.sequences, torch.tensor([[7, 8], [9, 10], [11, 12]])], dim=1)
    full_mask = torch.cat([mask, torch.ones(3, turn2.shape[1] - mask.shape[1], dtype=mask.dtype)], dim=1)
    kw = dict(max_new_tokens=6, eos_token_id=None, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    resumed = generate(ours, turn2, past_key_values=first.past_key_values, **kw)
    scratch = generate(ours, turn2, attention_mask=full_mask, **kw)
    assert torch.equal(resumed.sequences, scratch.sequences)
    for a, b in zip(resumed.logits, scratch.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    expected = hf.generate(input_ids=turn2, attention_mask=full_mask, max_new_tokens=6, eos_token_id=None,
                           pad_token_id=0)
    assert torch.equal(resumed.sequences, expected)


def test_continuation_runs_only_the_new_tokens() -> None:
    model = BigramModel([[0.1, 0.6, 0.2, 0.1]] * 4)
    first = generate(model, torch.tensor([[0, 2]]), max_new_tokens=3, return_dict_in_generate=True)
    model.calls.clear()
    turn2 = torch.cat([first.sequences, torch.tensor([[3, 3]])], dim=1)  # 5 cached-or-new ids + 2 new
    generate(model, turn2, past_key_values=first.past_key_values, max_new_tokens=2)
    # the cache holds the first 4 columns; the last generated token and the 2 new ones are read, then 1 per step
    assert [c.shape[1] for c in model.calls] == [3, 1]


def test_continuation_checks_the_prefix() -> None:
    _, ours = model_pair()
    first = generate(ours, torch.tensor([[1, 5, 6]]), max_new_tokens=3, return_dict_in_generate=True)
    wrong = torch.tensor([[1, 5, 9, 9, 9, 9, 4]])
    with pytest.raises(GenerationConfigError, match="do not start with"):
        generate(ours, wrong, past_key_values=first.past_key_values, max_new_tokens=2)
    with pytest.raises(GenerationConfigError, match="at least one new token"):
        generate(ours, first.sequences[:, :3], past_key_values=first.past_key_values, max_new_tokens=2)
