"""`nexttoken bench --speculative`: tokens/s with and without speculative decoding, acceptance, and a check that
the speculative output is the plain output token for token.

The prompt is input-grounded: it quotes a text and then starts quoting it again, and the text is one the model
does repeat (see `grounded_prompt`; a random-weight shape, which has no tokenizer, gets a random id sequence
shown twice). Drafts come from prompt lookup, a draft model folder, or
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

OPENING = 16  # tokens of the quoted text that the prompt repeats after the quote


def grounded_prompt(llm, prompt_len: int, new_tokens: int = 64, seed: int = 0) -> list[int]:  # noqa: ANN001
    """A prompt that quotes a text and then starts quoting it again, the text being one the model does copy.

    A model with a tokenizer: a story the model writes itself (greedy, from "Once upon a time", prompt_len tokens
    or enough for new_tokens of copying), S, then the prompt S + S[:OPENING]. A small model does not copy an
    arbitrary text (its first continuation of that prompt keeps ~0 of S's tokens on the packaged model), so S is
    then refined twice to the text the model writes when it quotes itself: S <- S[:OPENING] + the greedy
    continuation of S + S[:OPENING]. After that the continuation repeats S token for token (the packaged model:
    64 of 64), which is the input-grounded task (summaries, edits, quoting) that prompt lookup is for. A
    random-weight shape, which has no tokenizer, gets a random id sequence shown twice."""
    if llm.tokenizer is None:
        g = torch.Generator().manual_seed(seed)
        half = torch.randint(3, llm.model.config.vocab_size, (max(2, prompt_len // 2),), generator=g).tolist()
        return [1] + half + half[: max(1, len(half) // 4)]
    length = max(prompt_len, new_tokens + OPENING)
    start = llm.encode("Once upon a time")
    story = start + llm.generate([start], max_new_tokens=length - len(start), do_sample=False,
                                 ignore_eos=True)[0].token_ids
    for _ in range(2):  # the model's own quotation of its story: a fixed point after one or two rounds
        again = llm.generate([story + story[1:OPENING]], max_new_tokens=len(story) - OPENING, do_sample=False,
                             ignore_eos=True)[0].token_ids
        story = story[:OPENING] + again
    return story + story[1:OPENING]


def draft_from_target(path: Path, dtype: str | None, layers: int | None, noise: float, seed: int = 0,
                      quantize: str | None = None):  # noqa: ANN201
    """A fresh copy of the target cut to its first `layers` blocks, each weight plus N(0, (noise * its std)^2), then
    optionally quantized (`quantize`: int8, int4, bf16 as in nexttoken.load) so that its step costs less."""
    from ..model import load_model
    from ..model.quant.quantize import apply_quantization

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
    return apply_quantization(draft, quantize)


class TailScale:
    """Sets how much the target's blocks from `first` on add to the residual stream: their attention output
    (wo, o_proj) and MLP output (w2, down_proj) projections times `eps`, in place (a quantized layer's scales,
    which multiply every weight of a row, stand for its weights). With eps = 0 the target computes exactly what
    its first `first` blocks compute, so a draft made of those blocks (`draft_from_target(layers=first)`) agrees
    with it everywhere; raising eps moves the target away from the draft, which sweeps the acceptance rate while
    the draft stays a fraction of the target's cost. The original weights are kept, so every setting is exact."""

    def __init__(self, model, first: int) -> None:  # noqa: ANN001
        if not 0 < first < len(model.layers):
            raise ValueError(f"the target's tail starts after block {first}, but it has {len(model.layers)} blocks: "
                             "pass --draft-layers between 1 and the number of blocks - 1")
        self.tensors = []
        for block in model.layers[first:]:
            for linear in (block.attention.wo, getattr(block.mlp, "w2", None)):
                if linear is None:
                    raise ValueError("--target-tail-scale needs a dense MLP in every block (not a mixture of experts)")
                t = getattr(linear, "scale", None)
                t = linear.weight if t is None else t
                if not t.is_floating_point():
                    raise ValueError(f"--target-tail-scale cannot scale a {type(linear).__name__} target (use "
                                     "--quantize none, bf16 or int8)")
                self.tensors.append((t, t.detach().clone()))

    @torch.no_grad()
    def set(self, eps: float) -> None:
        for t, original in self.tensors:
            t.copy_((original.float() * eps).to(t.dtype))


def measure(llm, prompt: list[int], batch: int, new_tokens: int, rounds: int,  # noqa: ANN001
            variants: dict[str, dict], progress: Callable[[str], None],
            clock: Callable[[], float] = time.perf_counter) -> list[dict]:
    """Interleaved rounds of plain greedy and each speculative variant (options for LLM.generate) on `batch`
    copies of the prompt; the best round of each (the machine's noise only ever slows a round down). `clock`:
    time.process_time times by this process's CPU time (one thread on a machine shared with other work)."""
    prompts = [prompt] * batch
    base = dict(max_new_tokens=new_tokens, do_sample=False, ignore_eos=True)
    llm.generate(prompts, **base)  # warm: the engine, its caches and kernels
    times: dict[str, list[float]] = {name: [] for name in ["plain", *variants]}
    stats: dict[str, tuple[int, int, int]] = {}
    same: dict[str, bool] = {name: True for name in variants}
    for r in range(rounds):
        for name in times:
            before = llm._driver.engine.stats() if llm._driver else None
            start = clock()
            out = llm.generate(prompts, **base, **variants.get(name, {}))
            times[name].append(clock() - start)
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
        if r["variant"].startswith("plain"):
            lines.append(f"| {r['variant']} | {r['batch']} | {r['tok_s']:.1f} | 1.00x | - | - | - |")
        else:
            lines.append(f"| {r['variant']} | {r['batch']} | {r['tok_s']:.1f} | {r['speedup']:.2f}x | "
                         f"{100 * r['acceptance']:.0f}% | {r['tokens_per_step']:.2f} | "
                         f"{'yes' if r['identical'] else 'NO'} |")
    return "\n".join(lines)
