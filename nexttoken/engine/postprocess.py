"""After the forward: choose each request's token from its own logits row, then stop checks and streaming text.

Rows are handled one request at a time because requests differ in options: each applies its own processor
chain and draws from its own generator. A greedy request with no processors skips straight to the argmax.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from ..generation.stopping import stop_string_holdback
from .sequence import Sequence, TokenEvent


def advance(seq: Sequence, logits: torch.Tensor, eos_ids: frozenset[int], max_model_len: int) -> TokenEvent:
    """Choose seq's next token from logits (1, V) float32, record it, decide whether seq is done."""
    p = seq.params
    scores = logits
    if len(seq.processors):
        scores = seq.processors(torch.tensor([seq.token_ids], device=logits.device), logits)
    token = int(seq.sampler(scores)[0])
    logp = F.log_softmax(logits[0], dim=-1)  # (V,) the model's own distribution, as the Python API reports
    chosen = float(logp[token])
    top: list[tuple[int, float]] = []
    if p.logprobs:
        best = torch.topk(logp, p.logprobs)
        top = list(zip(best.indices.tolist(), best.values.tolist()))
    seq.output_ids.append(token)
    seq.logprobs.append(chosen)
    seq.top_logprobs.append(top)
    now = time.monotonic()
    seq.first_token_time = seq.first_token_time or now
    seq.last_token_time = now
    _check_stop(seq, token, eos_ids, max_model_len)
    return snapshot(seq, [token], [chosen], [top], now)


def _check_stop(seq: Sequence, token: int, eos_ids: frozenset[int], max_model_len: int) -> None:
    p, n = seq.params, len(seq.output_ids)
    may_stop = n >= p.min_tokens
    if may_stop and token in p.stop_token_ids:
        seq.finish_reason, seq.stop_reason = "stop", token
        if p.include_stop_str_in_output:
            _push_text(seq, token)
    elif may_stop and not p.ignore_eos and token in eos_ids:
        seq.finish_reason = "stop"
    else:
        before = len(seq.text)
        _push_text(seq, token)
        if may_stop and p.stop:
            _find_stop_string(seq, max(0, before - p.stop_prefix_window + 1))
    if seq.finish_reason is None and (n >= seq.max_tokens or seq.num_tokens >= max_model_len):
        seq.finish_reason = "length"
    if seq.finish_reason is not None and seq.stop_reason is None and seq.detokenizer is not None:
        seq.text += seq.detokenizer.flush()  # an unfinished character at the very end


def _push_text(seq: Sequence, token: int) -> None:
    if seq.detokenizer is not None:
        seq.text += seq.detokenizer.push(token)


def _find_stop_string(seq: Sequence, search_from: int) -> None:
    hits = [(i, s) for s in seq.params.stop if (i := seq.text.find(s, search_from)) >= 0]
    if hits:
        at, stop = min(hits)
        seq.text = seq.text[: at + len(stop)] if seq.params.include_stop_str_in_output else seq.text[:at]
        seq.finish_reason, seq.stop_reason = "stop", stop


def snapshot(
    seq: Sequence,
    tokens: list[int],
    logprobs: list[float],
    top: list[list[tuple[int, float]]],
    now: float,
) -> TokenEvent:
    """The event for this step: new tokens, and the new text that can no longer be retracted."""
    safe = len(seq.text) if seq.finish_reason else len(seq.text) - stop_string_holdback(seq.text, seq.params.stop)
    text = seq.text[seq.streamed : safe] if safe > seq.streamed else ""
    seq.streamed = max(seq.streamed, safe)
    first = len(seq.output_ids) == len(tokens)
    return TokenEvent(
        request_id=seq.request_id,
        token_ids=tokens,
        text=text,
        logprobs=logprobs,
        top_logprobs=top,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
        num_prompt_tokens=len(seq.prompt_ids),
        num_output_tokens=len(seq.output_ids),
        time=now,
        arrival_time=seq.arrival_time,
        scheduled_time=seq.scheduled_time,
        prompt_logprobs=seq.prompt_logprobs if first else None,
        prefix_hit_tokens=seq.prefix_hit_tokens,
    )
