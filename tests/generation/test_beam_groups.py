"""Diverse (group) beam search, which transformers 5 moved out of its core, against hand-worked numbers
(Vijayakumar et al. 2016, arXiv:1610.02424, Hamming diversity as in transformers 4.x
HammingDiversityLogitsProcessor), and against plain beam search when the penalty is 0."""

from __future__ import annotations

import math

import pytest
import torch

from nexttoken.generation import generate
from support.decoding import PROMPTS, left_padded, model_pair
from support.bigram import BigramModel

TABLE = [
    [0.05, 0.5, 0.3, 0.15],  # after 0: group 0 takes 1; group 1, penalized on 1 (ln .5 - 1 < ln .3), takes 2
    [0.1, 0.1, 0.2, 0.6],  # after 1: group 0 takes 3
    [0.1, 0.1, 0.45, 0.35],  # after 2: group 1 takes 2 (3 was taken by group 0: ln .35 - 1 < ln .45)
    [0.25, 0.25, 0.25, 0.25],
]


def test_group_beam_hand_worked() -> None:
    model = BigramModel(TABLE)
    out = generate(model, torch.tensor([[0]]), max_new_tokens=2, num_beams=2, num_beam_groups=2,
                   diversity_penalty=1.0, num_return_sequences=2, return_dict_in_generate=True, output_scores=True)
    assert out.sequences.tolist() == [[0, 1, 3], [0, 2, 2]]
    want = [(math.log(0.5) + math.log(0.6)) / 2, (math.log(0.3) + math.log(0.45)) / 2]
    torch.testing.assert_close(out.sequences_scores, torch.tensor(want))
    assert out.beam_indices.tolist() == [[0, 0], [1, 1]]
    # group 1's first-step scores carry the penalty on group 0's token
    torch.testing.assert_close(out.scores[0][1], torch.tensor(TABLE[0]).log() - torch.tensor([0.0, 1.0, 0.0, 0.0]))


def test_without_penalty_the_groups_agree() -> None:
    out = generate(BigramModel(TABLE), torch.tensor([[0]]), max_new_tokens=2, num_beams=2, num_beam_groups=2,
                   diversity_penalty=0.0, num_return_sequences=2)
    assert out.tolist() == [[0, 1, 3], [0, 1, 3]]


def test_zero_penalty_groups_equal_beam_search_of_group_size() -> None:
    _, ours = model_pair()
    ids, mask = left_padded(PROMPTS)
    kw = dict(attention_mask=mask, max_new_tokens=6, eos_token_id=[2, 43], pad_token_id=3,
              return_dict_in_generate=True, output_scores=True)
    groups = generate(ours, ids, num_beams=4, num_beam_groups=2, diversity_penalty=0.0, num_return_sequences=2, **kw)
    beams = generate(ours, ids, num_beams=2, **kw)
    width = beams.sequences.shape[1]
    assert torch.equal(groups.sequences[::2, :width], beams.sequences)
    torch.testing.assert_close(groups.sequences_scores[::2], beams.sequences_scores)


@torch.no_grad()
def group_beam_reference(hf, prompt: list[int], steps: int, beams: int, groups: int, penalty: float):  # noqa: ANN001
    """Diverse beam search (Vijayakumar et al. 2016) as transformers 4.x ran it, written out on transformers'
    forward without a cache or EOS: groups take turns each step; a group's log-probs are penalised by
    `penalty` x how often earlier groups chose each token at this step; each group keeps its best beams;
    finished beams are scored sum / generated length and returned best first. (sequence, score) pairs."""
    size = beams // groups
    # Each group starts from one live beam (the others at -1e9, as transformers initialises them).
    state = [[(list(prompt), 0.0 if i == 0 else -1e9) for i in range(size)] for _ in range(groups)]
    for _ in range(steps):
        chosen: list[int] = []  # tokens taken at this step by earlier groups
        for g in range(groups):
            candidates = []
            for seq, score in state[g]:
                logp = hf(torch.tensor([seq])).logits[0, -1].float().log_softmax(-1)
                counts = torch.bincount(torch.tensor(chosen, dtype=torch.long), minlength=logp.shape[0])
                total = logp - penalty * counts[: logp.shape[0]] + score
                top = total.topk(2 * size)
                candidates += [(v, seq + [t]) for v, t in zip(top.values.tolist(), top.indices.tolist())]
            candidates.sort(key=lambda c: -c[0])  # stable: ties keep beam order, then token order
            state[g] = [(seq, v) for v, seq in candidates[:size]]
            chosen += [seq[-1] for seq, _ in state[g]]
    finals = [(seq[len(prompt):], score / steps) for group in state for seq, score in group]
    return sorted(finals, key=lambda f: -f[1])


def test_group_beam_equals_a_reference_loop_on_transformers() -> None:
    hf, ours = model_pair()
    ids, mask = left_padded(PROMPTS)
    out = generate(ours, ids, attention_mask=mask, max_new_tokens=5, eos_token_id=None, pad_token_id=3, num_beams=4,
                   num_beam_groups=2, diversity_penalty=1.5, num_return_sequences=4, return_dict_in_generate=True,
                   output_scores=True)
    P = ids.shape[1]
    for b, prompt in enumerate(PROMPTS):
        want = group_beam_reference(hf, prompt, 5, 4, 2, 1.5)
        got = out.sequences[4 * b : 4 * b + 4, P:].tolist()
        assert got == [seq for seq, _ in want]
        torch.testing.assert_close(out.sequences_scores[4 * b : 4 * b + 4], torch.tensor([s for _, s in want]),
                                   rtol=1e-4, atol=1e-4)
    # The penalty acts here: without it the groups' first tokens coincide.
    plain = group_beam_reference(hf, PROMPTS[0], 5, 4, 2, 0.0)
    assert [seq for seq, _ in plain] != [seq for seq, _ in group_beam_reference(hf, PROMPTS[0], 5, 4, 2, 1.5)]


def test_group_beam_validation() -> None:
    model = BigramModel(TABLE)
    with pytest.raises(ValueError, match="divisible"):
        generate(model, torch.tensor([[0]]), num_beams=3, num_beam_groups=2)
    with pytest.raises(ValueError, match="does not sample"):
        generate(model, torch.tensor([[0]]), num_beams=2, num_beam_groups=2, do_sample=True)
