"""`nexttoken bench --speculative`: tokens/s with and without speculative decoding, acceptance, and a check that
the speculative output is the plain output token for token.

The prompt is input-grounded: it quotes a text and then starts quoting it again, so a continuation that repeats
it is what a model that copies writes (a model with a tokenizer gets a passage of prose; a random-weight shape,
which has none, a random id sequence shown twice). Drafts come from prompt lookup, a draft model folder, or
drafts made from the target itself: its first `layers` blocks (sharing nothing, a fresh copy) with every weight
perturbed by `noise` times its own spread, which sets the acceptance rate while the draft stays cheaper than
the target.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Callable

import torch

PASSAGE = (
    "The little robot walked to the old library at the end of the street. It opened a big book about the sea, and "
    "read about fish, ships and storms, about sailors who found their way by the stars, and about a lighthouse "
    "that stood alone on a rock for a hundred years. Then it closed the book and went home to sleep."
)


def grounded_prompt(llm, prompt_len: int, seed: int = 0) -> list[int]:  # noqa: ANN001
    """A prompt that quotes a text, then starts quoting it again (~prompt_len tokens)."""
    if llm.tokenizer is not None:
        text = PASSAGE
        return llm.encode(f"{text}\n\nThe same text, word for word:\n\n{text[: len(text) // 4]}")
    g = torch.Generator().manual_seed(seed)
    half = torch.randint(3, llm.model.config.vocab_size, (max(2, prompt_len // 2),), generator=g).tolist()
    return [1] + half + half[: max(1, len(half) // 4)]


def draft_from_target(path: Path, dtype: str | None, layers: int | None, noise: float, seed: int = 0):  # noqa: ANN201
    """A fresh copy of the target cut to its first `layers` blocks, each weight plus N(0, (noise * its std)^2)."""
    from ..model import load_model

    draft = load_model(path, dtype=dtype)
    if layers is not None and layers < draft.config.num_hidden_layers:
        draft.layers = draft.layers[:layers]
        draft.config = dataclasses.replace(draft.config, num_hidden_layers=layers)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            if noise and p.numel() > 1:
                std = p.float().std()
                p.add_((torch.randn(p.shape, generator=g) * std * noise).to(p.dtype))
    return draft


def measure(llm, prompt: list[int], batch: int, new_tokens: int, rounds: int,  # noqa: ANN001
            variants: dict[str, dict], progress: Callable[[str], None]) -> list[dict]:
    """Interleaved rounds of plain greedy and each speculative variant (options for LLM.generate) on `batch`
    copies of the prompt; the best round of each (the machine's noise only ever slows a round down)."""
    prompts = [prompt] * batch
    base = dict(max_new_tokens=new_tokens, do_sample=False, ignore_eos=True)
    llm.generate(prompts, **base)  # warm: the engine, its caches and kernels
    times: dict[str, list[float]] = {name: [] for name in ["plain", *variants]}
    stats: dict[str, tuple[int, int, int]] = {}
    same: dict[str, bool] = {name: True for name in variants}
    for r in range(rounds):
        for name in times:
            before = llm._driver.engine.stats() if llm._driver else None
            start = time.perf_counter()
            out = llm.generate(prompts, **base, **variants.get(name, {}))
            times[name].append(time.perf_counter() - start)
            after = llm._driver.engine.stats()
            if name == "plain":
                reference = [c.token_ids for c in out]
            else:
                same[name] &= [c.token_ids for c in out] == reference
                d0 = (0, 0, 0) if before is None else (before.spec_draft_tokens_total,
                                                       before.spec_accepted_tokens_total, before.spec_steps_total)
                stats[name] = (after.spec_draft_tokens_total - d0[0], after.spec_accepted_tokens_total - d0[1],
                               after.spec_steps_total - d0[2])
        progress(f"batch {batch}, round {r + 1}/{rounds}: " + ", ".join(
            f"{n} {batch * new_tokens / t[-1]:.1f} tok/s" for n, t in times.items()))
    plain = min(times["plain"])
    rows = [dict(variant="plain", batch=batch, tok_s=batch * new_tokens / plain, speedup=1.0)]
    for name in variants:
        drafted, kept, steps = stats[name]
        best = min(times[name])
        rows.append(dict(variant=name, batch=batch, tok_s=batch * new_tokens / best, speedup=plain / best,
                         acceptance=kept / drafted if drafted else 0.0,
                         tokens_per_step=(kept + steps) / steps if steps else 0.0, identical=same[name]))
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| variant | batch | tokens/s | speedup | acceptance | tokens per verification | same output |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["variant"] == "plain":
            lines.append(f"| plain | {r['batch']} | {r['tok_s']:.1f} | 1.00x | - | - | - |")
        else:
            lines.append(f"| {r['variant']} | {r['batch']} | {r['tok_s']:.1f} | {r['speedup']:.2f}x | "
                         f"{100 * r['acceptance']:.0f}% | {r['tokens_per_step']:.2f} | "
                         f"{'yes' if r['identical'] else 'NO'} |")
    return "\n".join(lines)
