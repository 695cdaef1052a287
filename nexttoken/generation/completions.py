"""Completions for the strategies that return other than one row per prompt (beam search, group beam search,
num_return_sequences samples) or that run their own loop (contrastive search): run the low-level `generate` and
cut each returned row into a completion. The high-level LLM API uses this; the decode loop is not involved.
"""

from __future__ import annotations

from typing import Any, Callable


from .generate import generate, left_pad, resolve_config
from .logprobs import compute_transition_scores


def searched_completions(llm: Any, prompts: list[list[int]], options: dict[str, Any], make: Callable[..., Any]) -> list:
    """`make(text, token_ids, prompt_token_ids, finish_reason, logprobs, ...)` per returned row, prompt-major."""
    options = dict(options)
    processors, criteria = options.pop("logits_processor", None), options.pop("stopping_criteria", None)
    cfg = resolve_config(llm.model, None, options)
    pad = llm._pad_id(cfg)
    ids, mask = left_pad(prompts, pad)
    width = ids.shape[1]
    options.update(return_dict_in_generate=True, output_logits=True, pad_token_id=pad)
    out = generate(llm.model, ids, attention_mask=mask, logits_processor=processors, stopping_criteria=criteria,
                   tokenizer=llm.tokenizer, **options)
    new = out.sequences[:, width:]
    n = new.shape[0] // len(prompts)
    if out.beam_indices is not None:  # beams: each row's own length, log-probs through its beam's history
        lengths = (out.beam_indices >= 0).sum(dim=1).tolist()
        logprobs = compute_transition_scores(out.sequences, out.logits, out.beam_indices, normalize_logits=True)
        finished = [bool(L) and int(new[r, L - 1]) in cfg.eos_ids for r, L in enumerate(lengths)]
    else:
        lengths, logprobs, finished = [], out.logprobs, out.finished.tolist()
        for r in range(new.shape[0]):
            hits = [i for i, t in enumerate(new[r].tolist()) if t in cfg.eos_ids]
            lengths.append(hits[0] + 1 if hits and finished[r] else new.shape[1])
    rows = []
    for r in range(new.shape[0]):
        L = lengths[r]
        tokens = new[r, :L].tolist()
        rows.append(make(
            text=llm._text(prompts[r // n], tokens, cfg), token_ids=tokens, prompt_token_ids=prompts[r // n],
            finish_reason="stop" if finished[r] else "length",
            logprobs=logprobs[r, :L].tolist() if logprobs is not None else [],
        ))
    return rows
