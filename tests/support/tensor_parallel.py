"""Comparing a tensor-parallel model with the same model in one process (no tests here)."""

from __future__ import annotations

GREEDY = dict(max_new_tokens=16, do_sample=False)
SAMPLED = dict(max_new_tokens=16, do_sample=True, temperature=0.9, top_k=40, seed=7)


def _runs(llm, prompts, **options):  # noqa: ANN001, ANN202
    out = llm.generate(prompts, **options)
    return [c.token_ids for c in out], [c.logprobs for c in out]


def assert_same(tp, one, prompts, tol: float = 1e-4, **options) -> None:  # noqa: ANN001
    ids_tp, lp_tp = _runs(tp, prompts, **options)
    ids_one, lp_one = _runs(one, prompts, **options)
    assert ids_tp == ids_one
    for a, b in zip(lp_tp, lp_one):
        assert max(abs(x - y) for x, y in zip(a, b)) < tol
