"""Contrastive search (Su et al. 2022, arXiv:2202.06417; transformers 4.x `_contrastive_search` /
`_ranking_fast`), which transformers 5 moved out of its core, against hand-worked numbers."""

from __future__ import annotations

import math

import torch

from nexttoken.generation import generate
from nexttoken.generation.search.contrastive import degeneration_scores
from support.decoding import PROMPTS, left_padded, model_pair
from support.bigram import BigramModel

R = 1 / math.sqrt(2)
TABLE = [
    [0.1, 0.5, 0.4, 0.0001],  # after 0: candidates 1 (p .5) and 2 (p .4)
    [0.25, 0.25, 0.25, 0.25],
    [0.3, 0.05, 0.25, 0.4],  # after 2: candidates 3 (p .4) and 0 (p .3)
    [0.25, 0.25, 0.25, 0.25],
]
HIDDEN = [[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [R, R]]  # 1 points where 0 does; 2 is orthogonal to both


def test_contrastive_hand_worked() -> None:
    # Step 1, context {h0}: score(1) = 0.4 * .5 - 0.6 * cos(h1, h0) = -0.4; score(2) = 0.4 * .4 - 0 = 0.16 -> 2.
    # Step 2, context {h0, h2}: score(3) = 0.4 * .4 - 0.6 * 0.7071 = -0.264; score(0) = 0.4 * .3 - 0.6 = -0.48 -> 3.
    model = BigramModel([row[:] for row in TABLE], HIDDEN)
    # Row 0 is left-padded with token 2: masked out of the context, else cos(h2, h2) = 1 would change step 1.
    ids, mask = torch.tensor([[2, 0], [1, 0]]), torch.tensor([[0, 1], [1, 1]])
    out = generate(model, ids, attention_mask=mask, max_new_tokens=2, penalty_alpha=0.6, top_k=2, pad_token_id=2)
    assert out[:, 2:].tolist() == [[2, 3], [2, 3]]
    greedy = generate(model, ids, attention_mask=mask, max_new_tokens=2, pad_token_id=2)
    assert greedy[:, 2].tolist() == [1, 1]


def test_ranking_numbers() -> None:
    context = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])  # (B, L, H)
    cands = torch.tensor([[[R, R], [1.0, 0.0]]])  # (B, K, H)
    probs = torch.tensor([[0.4, 0.3]])
    valid = torch.tensor([[True, True]])
    got = degeneration_scores(context, valid, cands, probs, 0.6)
    torch.testing.assert_close(got, torch.tensor([[0.4 * 0.4 - 0.6 * R, 0.4 * 0.3 - 0.6]]))


@torch.no_grad()
def contrastive_reference(hf, prompt: list[int], steps: int, k: int, alpha: float) -> list[int]:  # noqa: ANN001
    """Contrastive search written out on transformers' forward, without a cache: each step scores the top-k
    candidates by (1 - alpha) * p - alpha * max cosine(h(candidate), h(every earlier token)), h the final norm's
    output (captured by a hook), and keeps the best. An independent reference for nexttoken's batched version."""
    captured = {}
    hook = hf.model.norm.register_forward_hook(lambda m, a, out: captured.update(h=out[0].float()))
    try:
        ids = list(prompt)
        logits = hf(torch.tensor([ids])).logits[0, -1].float()
        context = captured["h"]  # (P, H)
        for _ in range(steps):
            top_p, top_ids = logits.softmax(-1).topk(k)
            scored = []
            for p, t in zip(top_p.tolist(), top_ids.tolist()):
                cand_logits = hf(torch.tensor([ids + [t]])).logits[0, -1].float()
                h = captured["h"][-1]  # (H,)
                cos = torch.nn.functional.cosine_similarity(h[None], context, dim=-1).max().item()
                scored.append(((1 - alpha) * p - alpha * cos, t, h, cand_logits))
            best = max(scored, key=lambda s: s[0])  # the first of equal scores, as argmax
            ids.append(best[1])
            context = torch.cat([context, best[2][None]])
            logits = best[3]
        return ids[len(prompt):]
    finally:
        hook.remove()


def test_contrastive_equals_a_reference_loop_on_transformers() -> None:
    hf, ours = model_pair()
    ids, mask = left_padded(PROMPTS)
    got = generate(ours, ids, attention_mask=mask, max_new_tokens=8, penalty_alpha=0.6, top_k=4, eos_token_id=None,
                   pad_token_id=0)
    for row, prompt in zip(got[:, ids.shape[1]:].tolist(), PROMPTS):
        assert row == contrastive_reference(hf, prompt, 8, 4, 0.6)


def test_contrastive_on_stories260k_equals_the_reference_loop(shared_dir) -> None:
    from transformers import AutoModelForCausalLM

    import nexttoken

    folder = shared_dir / "models" / "stories260k"
    llm, hf = nexttoken.load(folder), AutoModelForCausalLM.from_pretrained(folder).eval()
    prompt = llm.encode("Once upon a time, there was a little")
    got = llm.generate(prompt, max_new_tokens=12, penalty_alpha=0.6, top_k=5, eos_token_id=None)
    want = contrastive_reference(hf, prompt, 12, 5, 0.6)
    assert got.token_ids == want
    assert want != llm.generate(prompt, max_new_tokens=12, eos_token_id=None).token_ids  # it is not greedy here


def test_contrastive_with_alpha_zero_is_greedy_on_a_real_model() -> None:
    _, ours = model_pair()
    ids, mask = left_padded(PROMPTS)
    kw = dict(attention_mask=mask, max_new_tokens=8, eos_token_id=2, pad_token_id=0)
    a = generate(ours, ids, penalty_alpha=1e-9, top_k=4, **kw)
    assert torch.equal(a, generate(ours, ids, **kw))
    b = generate(ours, ids, penalty_alpha=0.6, top_k=4, **kw)
    assert b.shape[0] == 3 and not torch.equal(a, b)  # (what b must be: test_contrastive_equals_a_reference_loop...)
