"""After the forward: choose each request's token from its own logits row and hand it to its output pipeline.

Rows are handled one request at a time because requests differ in options: each applies its own processor
chain and draws from its own generator. A greedy request with no processors skips straight to the argmax.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from ..generation.decode import StepOutput
from ..generation.output_pipeline import Delta
from ..generation.sampling import Sampler
from ..generation.processors.structured import allowed_tokens
from ..model import kernels
from .sequence import HookState, Sequence, TokenEvent


def plain_greedy(seq: Sequence) -> bool:
    """The argmax with no processors, criteria or hooks, or with structured output's mask alone (its log-probs
    raw): such rows are chosen together (vLLM's all-greedy path, with the grammar bitmask applied in one op)."""
    s = seq.sampler
    alone = not len(seq.processors) or (
        len(seq.processors) == 1 and seq.grammar is not None and seq.params.logprobs_mode == "raw")
    plain = seq.stopping is None and not seq.hooks and seq.trace is None  # a traced row records its own choice
    return alone and plain and isinstance(s, Sampler) and s.greedy


def advance_greedy(seqs: list[Sequence], logits: torch.Tensor) -> list[TokenEvent]:
    """Plain greedy rows, (rows, V) float32 logits: one argmax and one log-softmax for them all. Each row's numbers
    are its own (both reduce within a row), so this gives what `advance` gives row by row. Rows under a grammar
    take their argmax over the tokens it allows; their log-probs stay the model's (logprobs_mode "raw").

    A row whose own work raises (its grammar's mask, its detokenizer) ends with finish_reason "error" (`fail`);
    the others go on: each row's numbers are its own, so they are what they would have been without it."""
    events: dict[int, TokenEvent] = {}
    masks: dict[int, torch.Tensor] = {}
    for i, seq in enumerate(seqs):
        if seq.grammar is not None:
            try:
                masks[i] = seq.grammar.mask_for(seq.out.token_ids)
            except Exception as e:  # noqa: BLE001 - this request ends; its batch-mates go on
                events[i] = fail(seq, e)
    scores = logits
    if masks:
        rows = list(masks)
        forbidden = ~allowed_tokens(torch.stack([masks[i] for i in rows]), logits.shape[1])  # (len(rows), V)
        scores = logits.clone()
        scores[rows] = logits[rows].masked_fill(forbidden, -torch.inf)
    tokens = kernels.argmax(scores).tolist()
    logp = torch.log_softmax(logits, dim=-1)  # (rows, V): the raw distribution
    chosen = logp.gather(1, torch.tensor(tokens)[:, None]).squeeze(1).tolist()
    now = time.monotonic()
    for i, (seq, token) in enumerate(zip(seqs, tokens)):
        if i not in events:
            events[i] = guarded(seq, lambda: push_chosen(seq, token, chosen[i], logp[i], now))
    return [events[i] for i in range(len(seqs))]


def guarded(seq: Sequence, work: Callable[[], TokenEvent]) -> TokenEvent:
    """`work`'s event, or, when it raises, seq ended alone with finish_reason "error" (`fail`)."""
    try:
        return work()
    except Exception as e:  # noqa: BLE001 - a request whose work fails at run time ends alone; the rest go on
        return fail(seq, e)


def fail(seq: Sequence, error: BaseException) -> TokenEvent:
    """End seq because its own work raised (its options at run time: a grammar past its limits, a processor, a
    sampler, its detokenizer, a hook, its speculation): finish_reason "error", the error as stop_reason (first
    line; the server logs it and answers that request alone with a 500). The engine frees its slot after the step."""
    text = str(error).strip()
    reason = f"{type(error).__name__}: {text.splitlines()[0][:500] if text else ''}"
    out = seq.out
    out.finish_reason, out.stop_reason = "error", reason  # no flush: the detokenizer may be what failed
    return snapshot(seq, Delta([], "", [], [], "error", reason), time.monotonic())


def push_chosen(seq: Sequence, token: int, logprob: float, logp: torch.Tensor, now: float) -> TokenEvent:
    """Record a token chosen outside `advance` (a batched argmax): its log-prob, the top-N of logp (V,) raw
    log-probabilities, the request's timing; its event."""
    n = seq.params.top_logprobs
    best = torch.topk(logp, min(n, logp.shape[0])) if n else None
    top = list(zip(best.indices.tolist(), best.values.tolist())) if best is not None else []
    delta = seq.out.push(token, logprob, top)
    seq.first_token_time = seq.first_token_time or now
    seq.last_token_time = now
    return snapshot(seq, delta, now)


def advance(seq: Sequence, logits: torch.Tensor, chooser: Callable[[torch.Tensor], int] | None = None) -> TokenEvent:
    """Choose seq's next token from logits (1, V) float32, record it, decide whether seq is done. `chooser`
    (speculative decoding's rejection rule) replaces the request's sampler: (1, V) processed scores -> token. A
    traced request (seq.trace) makes the same calls through its recorder, which notes what each one did."""
    ids = torch.tensor([seq.token_ids], device=logits.device) if len(seq.processors) else None  # (1, L)
    if seq.trace is None:
        scores = seq.processors(ids, logits) if ids is not None else logits
        token = int(seq.sampler(scores)[0]) if chooser is None else chooser(scores)
    else:  # the same calls, one processor at a time, each recorded
        scores, token = seq.trace.choose(seq.processors.processors, seq.sampler, ids, logits, chooser)
    logprob, top = seq.out.logprobs_of(logits[0], scores[0], token)
    stop = False
    stop_start = time.perf_counter() if seq.trace is not None else 0.0
    if seq.stopping is not None:  # a caller's criteria see the ids with the new token, as in the decode loop
        with_token = torch.tensor([seq.token_ids + [token]], device=logits.device)
        stop = bool(seq.stopping(with_token, scores)[0]) if seq.trace is None else seq.trace.criteria(
            seq.stopping, with_token, scores)
    delta = seq.out.push(token, logprob, top, stop)
    if seq.trace is not None:
        seq.trace.stopped(seq.out, token, time.perf_counter() - stop_start)
    now = time.monotonic()
    seq.first_token_time = seq.first_token_time or now
    seq.last_token_time = now
    if seq.hooks:
        state = HookState(seq)
        done = torch.tensor([delta.finish_reason is not None])
        step = StepOutput(torch.tensor([token]), logits, scores, done, ~done, None)
        for hook in seq.hooks:
            hook.after_step(state, step)  # type: ignore[arg-type]
    return snapshot(seq, delta, now)


def snapshot(seq: Sequence, delta: Delta, now: float) -> TokenEvent:
    """The event for this step: the pipeline's delta with the request's bookkeeping."""
    first = len(seq.out.token_ids) == len(delta.token_ids)
    return TokenEvent(
        request_id=seq.request_id,
        token_ids=delta.token_ids,
        text=delta.text,
        logprobs=delta.logprobs,
        top_logprobs=delta.top_logprobs,
        finish_reason=delta.finish_reason,
        stop_reason=delta.stop_reason,
        num_prompt_tokens=len(seq.prompt_ids),
        num_output_tokens=len(seq.out.token_ids),
        time=now,
        arrival_time=seq.arrival_time,
        scheduled_time=seq.scheduled_time,
        prompt_logprobs=seq.prompt_logprobs if first else None,
        prefix_hit_tokens=seq.prefix_hit_tokens,
        trace=traced(seq) if seq.trace is not None and delta.finish_reason else None,
        spec_draft_tokens=seq.spec.drafted if seq.spec is not None else 0,
        spec_accepted_tokens=seq.spec.accepted if seq.spec is not None else 0,
        hidden_stop=delta.hidden_stop,
    )


def traced(seq: Sequence) -> dict:
    """A finished traced request's trace, with what it produced."""
    out = seq.out
    return seq.trace.to_dict({"output_ids": list(out.token_ids), "text": out.text,  # type: ignore[union-attr]
                              "finish_reason": out.finish_reason, "stop_reason": out.stop_reason})
