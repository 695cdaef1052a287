"""Completions from the search strategies (beam search, beam sampling, group beam, contrastive search): run the
padded-batch `generate` once, then feed each returned row through the output pipeline, so stop strings, text and
finish reasons follow the same rules as every decoded sequence. `LLM.generate` chooses this by the options'
generation mode, never as a fallback.
"""

from __future__ import annotations

from typing import Any, Sequence

from ..text.detokenizer import IncrementalDetokenizer
from ..model import Transformer
from .config import GenerationConfig
from .generate import generate, left_pad
from .logprobs import compute_transition_scores
from .output_pipeline import Completion, replay
from .processors.chain import LogitsProcessor
from .stopping import StoppingCriterion


def searched_completions(
    model: Transformer,
    tokenizer: Any,
    prompts: list[list[int]],
    cfg: GenerationConfig,
    pad_token_id: int,
    logits_processor: Sequence[LogitsProcessor] = (),
    stopping_criteria: Sequence[StoppingCriterion] = (),
) -> list[Completion]:
    """Every returned row (num_return_sequences per prompt, prompt-major) as a Completion."""
    ids, mask = left_pad(prompts, pad_token_id)
    width = ids.shape[1]
    run = cfg.updated(return_dict_in_generate=True, output_logits=True, pad_token_id=pad_token_id)
    out = generate(model, ids, attention_mask=mask, generation_config=run, logits_processor=list(logits_processor),
                   stopping_criteria=list(stopping_criteria), tokenizer=tokenizer)
    new = out.sequences[:, width:]
    n = new.shape[0] // len(prompts)
    if out.beam_indices is not None:  # beams: each row's own length, log-probs through its beam's history
        lengths = (out.beam_indices >= 0).sum(dim=1).tolist()
        logprobs = compute_transition_scores(out.sequences, out.logits, out.beam_indices, normalize_logits=True)
        ended = [False] * new.shape[0]  # a beam ends with EOS (the pipeline sees it) or at the length budget
    else:
        logprobs, ended = out.logprobs, out.finished.tolist()
        lengths = [_row_length(new[r].tolist(), cfg.stop_ids, ended[r]) for r in range(new.shape[0])]
    rows = []
    for r in range(new.shape[0]):
        prompt, L = prompts[r // n], lengths[r]
        detok = IncrementalDetokenizer(tokenizer, cfg.skip_special_tokens, prompt_ids=prompt) if tokenizer else None
        values = logprobs[r, :L].tolist() if logprobs is not None else [0.0] * L
        pipeline = replay(cfg, new[r, :L].tolist(), values, detok, ended[r])
        prompt_text = tokenizer.decode(prompt, skip_special_tokens=True) if tokenizer and cfg.echo else ""
        rows.append(pipeline.completion(prompt, prompt_text=prompt_text))
    return rows


def _row_length(row: list[int], stop_ids: frozenset[int], finished: bool) -> int:
    """Generated columns that belong to the row: up to its first stop id when it finished, else all of them."""
    hits = [i for i, t in enumerate(row) if t in stop_ids]
    return hits[0] + 1 if hits and finished else len(row)

