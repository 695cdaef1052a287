"""The decode loop: prefill, then forward -> processors -> choose -> stop -> emit, one step at a time.

Everything else (which processors, when to stop, what to collect, how to print) is decided before the loop
starts, in a DecodePlan, and consumed after it, from the StepOutputs it yields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol, Sequence

import torch

from ..errors import GenerationConfigError
from ..model import ForwardBatch, KVCache, Transformer
from ..model import fused
from .processors.chain import ProcessorChain
from .sampling import Sampler
from .stopping import EosToken, StoppingChain


@dataclass
class GenerationCache:
    """What a finished generation leaves behind to continue from: its KV cache and the ids that fill it."""

    kv: KVCache
    tokens: torch.Tensor  # (B, C) the ids whose K/V are in kv's first C columns
    key_valid: torch.Tensor  # (B, C) bool: real tokens (False for left padding)


class StepHook(Protocol):
    """Per-step extension point (docs/hooks.md): extra model inputs before each forward, updates after each step."""

    def model_inputs(self, state: "DecodeState") -> dict[str, Any]:
        """Extra keyword arguments for this step's `model(ids, batch, cache, **extra)`."""
        ...

    def after_step(self, state: "DecodeState", step: "StepOutput") -> None:
        """Called once a step's tokens are chosen and appended; update the hook's own state here."""
        ...


@dataclass
class DecodePlan:
    """What one generation call will do, fixed before the first forward pass."""

    input_ids: torch.Tensor  # (B, P) left-padded prompts
    attention_mask: torch.Tensor  # (B, P) 1 for real tokens, 0 for padding
    max_new_tokens: int
    pad_token_id: int
    processors: ProcessorChain
    sampler: Callable[[torch.Tensor], torch.Tensor]  # (B, V) scores -> (B,) ids: Sampler or MirostatV2
    stopping: StoppingChain
    hooks: Sequence[StepHook] = ()
    past: GenerationCache | None = None  # continue from a previous generation's cache
    prompt_logprobs: bool = False
    # Whether the consumer reads each step's logits / scores. When it does not, plain greedy steps of one row run
    # natively several at a time (fused.greedy_chain), and their StepOutputs carry no logits.
    per_step_logits: bool = True


@dataclass
class DecodeState:
    """The growing sequences. Buffers are allocated once at full length and filled column by column."""

    tokens: torch.Tensor  # (B, P + max_new) prompt then generated ids; columns >= length not yet written
    key_valid: torch.Tensor  # (B, P + max_new) bool: column holds a real token (the attention mask)
    next_position: torch.Tensor  # (B, 1) rotary position of the token to be written next
    length: int  # columns written so far
    unfinished: torch.Tensor  # (B,) bool
    cache: KVCache
    cached: int = 0  # columns whose K/V are already in the cache
    prompt_logprobs: torch.Tensor | None = None  # (B, P) when asked: log p(token | previous), NaN where undefined
    # No column holds padding (generated columns never do, so this holds for the whole call): decode steps then
    # skip reading key_valid back to find it out.
    padding_free: bool = False

    @classmethod
    def start(cls, plan: DecodePlan, model: Transformer) -> "DecodeState":
        B, P = plan.input_ids.shape
        total = P + plan.max_new_tokens
        tokens = torch.full((B, total), plan.pad_token_id, dtype=torch.long, device=plan.input_ids.device)
        tokens[:, :P] = plan.input_ids
        key_valid = torch.ones((B, total), dtype=torch.bool, device=tokens.device)
        key_valid[:, :P] = plan.attention_mask.bool()
        next_position = plan.attention_mask.sum(dim=1, keepdim=True)  # real tokens so far = next position
        unfinished = torch.ones(B, dtype=torch.bool, device=tokens.device)
        if plan.past is None:
            return cls(tokens, key_valid, next_position, P, unfinished, model.new_cache(B, total),
                       padding_free=bool(key_valid.all()))
        C = check_continuation(plan.past, plan.input_ids)
        key_valid[:, :C] = plan.past.key_valid
        next_position = key_valid[:, :P].sum(dim=1, keepdim=True)
        return cls(tokens, key_valid, next_position, P, unfinished, plan.past.kv.extended(total), cached=C,
                   padding_free=bool(key_valid.all()))

    def prompt_positions(self) -> torch.Tensor:
        """(B, P) positions of the prompt tokens: left padding shifts each row so its first real token is 0."""
        mask = self.key_valid[:, : self.length].long()
        return (mask.cumsum(dim=1) - 1).clamp(min=0)

    def append(self, next_tokens: torch.Tensor) -> None:
        self.tokens[:, self.length] = next_tokens
        self.length += 1

    @property
    def ids(self) -> torch.Tensor:
        return self.tokens[:, : self.length]

    def generation_cache(self) -> GenerationCache:
        """The cache as it stands (the last chosen token is not in it yet: a continuation's prompt re-reads it)."""
        C = self.cached
        return GenerationCache(self.cache, self.tokens[:, :C].clone(), self.key_valid[:, :C].clone())


def check_continuation(past: GenerationCache, input_ids: torch.Tensor) -> int:
    """The number of cached columns, after checking that input_ids extends the cached ids."""
    B, C = past.tokens.shape
    if input_ids.shape[0] != B or input_ids.shape[1] <= C:
        raise GenerationConfigError(
            f"to continue from past_key_values, input_ids must hold the {B} previous sequence(s) ({C} cached ids "
            f"each) plus at least one new token; got shape {tuple(input_ids.shape)}"
        )
    if not torch.equal(input_ids[:, :C].to(past.tokens.device), past.tokens):
        raise GenerationConfigError(
            "input_ids do not start with the ids of past_key_values: pass the previous output's sequences "
            "followed by the new tokens"
        )
    return C


@dataclass
class StepOutput:
    tokens: torch.Tensor  # (B,) the ids chosen this step (pad for rows finished earlier)
    logits: torch.Tensor | None  # (B, V) float32, as the model produced them (None: a chained step, see below)
    scores: torch.Tensor | None  # (B, V) float32, after the processors (None likewise)
    finished: torch.Tensor  # (B,) bool: the row stopped at this step (EOS, stop string or user criterion)
    unfinished: torch.Tensor  # (B,) bool: the row is still running after this step
    state: DecodeState | None = field(default=None, repr=False)  # the loop's state (read-only for consumers)


def _extra_inputs(hooks: Sequence[StepHook], state: DecodeState) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    for hook in hooks:
        extra.update(hook.model_inputs(state))
    return extra


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """(B, T, V) logits and (B, T) ids -> (B, T) log p(ids[t] | logits[t])."""
    return logits.float().log_softmax(dim=-1).gather(-1, ids[..., None]).squeeze(-1)


def prefill(
    model: Transformer, state: DecodeState, plan: DecodePlan, sliding_window: int | None, all_positions: bool = False
) -> torch.Tensor:
    """Run the prompt columns not yet cached; (B, V) float32 logits of the last one (every position's, (B, T, V),
    when all_positions: contrastive search reads the hidden state of every prompt token)."""
    start, P = state.cached, state.length
    B = state.tokens.shape[0]
    write_index = torch.arange(start, P, device=state.tokens.device).expand(B, P - start)
    batch = ForwardBatch.build(
        state.prompt_positions()[:, start:], write_index, state.key_valid, P, sliding_window, write_start=start,
        last_only=not (plan.prompt_logprobs or all_positions),
    )
    logits = model(state.tokens[:, start:P], batch, state.cache, **_extra_inputs(plan.hooks, state)).float()
    state.cached = P
    if plan.prompt_logprobs:  # (B, T, V): token t is scored by the logits of column t - 1
        lp = torch.full((B, P), float("nan"), device=logits.device)
        lp[:, start + 1 :] = token_logprobs(logits[:, :-1], state.tokens[:, start + 1 : P])
        valid = state.key_valid[:, :P].clone()
        valid[:, 1:] &= state.key_valid[:, : P - 1]  # a token with no real token before it has no log-prob
        valid[:, 0] = False
        state.prompt_logprobs = lp.masked_fill(~valid, float("nan"))
    return logits if all_positions or not plan.prompt_logprobs else logits[:, -1]


def forward_last(model: Transformer, state: DecodeState, plan: DecodePlan, sliding_window: int | None) -> torch.Tensor:
    """Run the newest token of every row through the model; (B, V) float32 logits."""
    col = state.length - 1
    write_index = torch.full_like(state.next_position, col)
    batch = ForwardBatch.build(
        state.next_position, write_index, state.key_valid, state.length, sliding_window, write_start=col,
        padding_free=state.padding_free,
    )
    state.next_position = state.next_position + 1
    state.cached = state.length
    extra = _extra_inputs(plan.hooks, state)
    return model(state.tokens[:, col : col + 1], batch, state.cache, **extra).float()


@torch.inference_mode()
def decode_steps(model: Transformer, plan: DecodePlan) -> Iterator[StepOutput]:
    """Yield one StepOutput per generated column until every row stops or max_new_tokens is reached."""
    state = DecodeState.start(plan, model)
    if plan.max_new_tokens == 0:
        return
    window = model.config.sliding_window
    logits = prefill(model, state, plan, window)
    chained = chainable(model, state, plan, window)
    for step in range(plan.max_new_tokens):
        scores = plan.processors(state.ids, logits) if plan.processors else logits
        chosen = torch.where(state.unfinished, plan.sampler(scores), plan.pad_token_id)
        state.append(chosen)
        finished = plan.stopping(state.ids, scores) & state.unfinished
        state.unfinished = state.unfinished & ~finished
        out = StepOutput(chosen, logits, scores, finished, state.unfinished, state)
        for hook in plan.hooks:
            hook.after_step(state, out)
        yield out
        if step + 1 == plan.max_new_tokens or not state.unfinished.any():
            return
        if chained:  # the rest natively, CHAIN steps per call
            yield from greedy_chain(model, state, plan, plan.max_new_tokens - step - 1)
            return
        logits = forward_last(model, state, plan, window)


CHAIN = 16  # greedy steps per native call: a streamer sees tokens in bursts of this many


def chainable(model: Transformer, state: DecodeState, plan: DecodePlan, window: int | None) -> bool:
    """Whether the steps after the first can run as native greedy chains: one row, greedy, nothing per step in
    Python (no processors, hooks or per-step logits; stopping on EOS ids only), no padding, and a model whose
    native step takes them (fused.chains; it computes a sliding window itself). The tokens are the step-by-step
    loop's: each chained step is the same native step and the same argmax."""
    return (
        not plan.per_step_logits
        and state.tokens.shape[0] == 1
        and isinstance(plan.sampler, Sampler)
        and plan.sampler.greedy
        and not plan.processors
        and not plan.hooks
        and all(type(c) is EosToken for c in plan.stopping.criteria)
        and state.padding_free
        and state.tokens.device.type == "cpu"
        and fused.chains(model, state.cache)
    )


def greedy_chain(model: Transformer, state: DecodeState, plan: DecodePlan, remaining: int) -> Iterator[StepOutput]:
    """Up to `remaining` more greedy steps, CHAIN at a time in one native call each, yielded one StepOutput per
    token (logits and scores None) with the state as the step-by-step loop leaves it."""
    eos_ids = torch.cat([c.eos for c in plan.stopping.criteria] or [torch.empty(0, dtype=torch.long)])
    stop = set(eos_ids.tolist())
    while remaining > 0:
        col = state.length - 1  # the newest token: not in the cache yet
        got = fused.greedy_chain(model, state.cache, int(state.tokens[0, col]), int(state.next_position[0, 0]), col,
                                 min(CHAIN, remaining), eos_ids)
        if got is None:
            raise RuntimeError("the native greedy chain refused a step it was planned for")
        for token in got:  # the last one may be an EOS id: the native chain stops after it
            chosen, finished = torch.tensor([token]), torch.tensor([token in stop])
            state.next_position = state.next_position + 1
            state.append(chosen)
            state.cached = state.length - 1
            state.unfinished = state.unfinished & ~finished
            remaining -= 1
            yield StepOutput(chosen, None, None, finished, state.unfinished, state)
        if not state.unfinished.any():
            return
