"""The output pipeline: what one sequence's chosen tokens become. One object per sequence, fed a token at a time.

Every way of generating ends here: the engine (every `LLM.generate / stream / chat` and every server request)
pushes each step's token, and the search strategies (beams, contrastive) push each returned row's tokens after
the fact. It owns, for one sequence:

- stop conditions: stop token ids, EOS (unless `ignore_eos`), stop strings (searched in the text, OpenAI's
  semantics: anywhere in the generated text, not only at its end), `min_new_tokens`, a caller's criterion, length;
- incremental detokenizing, with the holdback that keeps back a tail that may still become a stop string, so
  streamed text is never retracted;
- log-probs of the chosen token and its top-N alternatives, of the raw or the processed distribution
  (`logprobs_mode`), prompt log-probs and `echo`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .config import GenerationConfig
from .stopping import stop_string_holdback

TopLogprobs = list[tuple[int, float]]  # (token id, log-probability), most likely first
PromptLogprobs = list[tuple[float, TopLogprobs] | None]  # per prompt token; the first has none


@dataclass
class Completion:
    """One finished sequence, as `LLM.generate` returns it."""

    text: str  # generated text, special tokens skipped, cut before a matched stop string
    token_ids: list[int]  # generated ids, including the EOS id that ended it
    prompt_token_ids: list[int]
    finish_reason: str  # "stop" (EOS, stop token, stop string or criterion), "length" or "tool_calls"
    logprobs: list[float]  # log-probability of each generated token (raw distribution unless logprobs_mode)
    # With top_logprobs=N: per generated token, its N most likely alternatives {id: log-prob}.
    top_logprobs: list[dict[int, float]] | None = None
    # With prompt_logprobs=True (or echo=True): log p(prompt token | the ones before); None for the first.
    prompt_logprobs: list[float | None] | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # LLM.chat with tools: the calls the model made (nexttoken.chat.ToolCall); `text` is then the content
    # outside them and finish_reason "tool_calls".
    tool_calls: list[Any] | None = None
    # LLM.chat with a thinking model (tools/reasoning.py): the thinking, split off `text` as the server's
    # reasoning_content is (None: no thinking, or a model that does not think).
    reasoning_content: str | None = None
    # With trace=True: why each token came out (generation/trace/recorder.py; nexttoken.generation.trace.page renders it).
    trace: dict[str, Any] | None = None
    # What the server's `usage` reports: tokens in the prompt and generated (echo leaves these counts alone), and,
    # under speculative decoding, the draft tokens the model kept and threw away (OpenAI's accepted / rejected
    # prediction tokens).
    prompt_tokens: int = 0
    completion_tokens: int = 0
    accepted_draft_tokens: int = 0
    rejected_draft_tokens: int = 0

    @property
    def reasoning(self) -> str | None:
        """The thinking: `reasoning_content`'s other name (the server sends both, as vLLM does)."""
        return self.reasoning_content


@dataclass(frozen=True)
class Delta:
    """What one pushed token changed: the text that became final (never retracted) and the finish, if any."""

    token_ids: list[int]
    text: str
    logprobs: list[float]
    top_logprobs: list[TopLogprobs]
    finish_reason: str | None
    stop_reason: int | str | None
    # The token ended the sequence as a stop id (EOS, a stop token) that the text leaves out: an API that reports
    # log-probs per token of the answer leaves it out too (OpenAI's and vLLM's `logprobs.content`).
    hidden_stop: bool = False


def token_logprobs(logits: torch.Tensor, token: int, top_n: int) -> tuple[float, TopLogprobs]:
    """(V,) logits or scores -> log p(token) and the top_n most likely (id, log p), best first."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top: TopLogprobs = []
    if top_n:
        best = torch.topk(logp, min(top_n, logp.shape[-1]))
        top = list(zip(best.indices.tolist(), best.values.tolist()))
    return float(logp[token]), top


class OutputPipeline:
    """One sequence's tokens -> text deltas, stop decisions and log-probs.

    `max_tokens` is the sequence's length budget (already cut to the context); `detokenizer` is an
    IncrementalDetokenizer started after the prompt, or None for token-id-only models.
    """

    def __init__(self, cfg: GenerationConfig, max_tokens: int, detokenizer: Any = None) -> None:
        self.cfg, self.max_tokens, self.detokenizer = cfg, max_tokens, detokenizer
        self.stop_ids = cfg.stop_ids
        self.stop_token_ids = frozenset(cfg.stop_token_ids or ())
        self.stops = cfg.stop_string_list
        self.window = max((len(s) for s in self.stops), default=0)  # characters a stop string can reach back
        self.min_tokens = cfg.min_new_tokens or 0
        self.token_ids: list[int] = []
        self.text = ""  # generated text so far (cut at a stop string once one is found)
        self.streamed = 0  # characters of `text` already handed out in deltas
        self.logprobs: list[float] = []
        self.top_logprobs: list[TopLogprobs] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def logprobs_of(self, logits: torch.Tensor, scores: torch.Tensor, token: int) -> tuple[float, TopLogprobs]:
        """The chosen token's log-prob and top-N from the (V,) raw logits or processed scores, as configured."""
        source = scores if self.cfg.logprobs_mode == "processed" else logits
        return token_logprobs(source, token, self.cfg.top_logprobs)

    def push(self, token: int, logprob: float, top: TopLogprobs = (), stop: bool = False) -> Delta:  # type: ignore[assignment]
        """Record one chosen token; `stop` is a caller's criterion saying the sequence is done."""
        assert not self.finished, "a finished sequence takes no more tokens"
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        self.top_logprobs.append(list(top))
        may_stop = len(self.token_ids) >= self.min_tokens
        hidden = False
        if may_stop and token in self.stop_token_ids:
            self._finish("stop", token)
            hidden = not self.cfg.include_stop_str_in_output
            if not hidden:
                self._push_text(token)
        elif may_stop and token in self.stop_ids:
            self._finish("stop", None)
            hidden = True
        else:
            before = len(self.text)
            self._push_text(token)
            if may_stop and self.stops:
                self._find_stop_string(max(0, before - self.window + 1))
        if not self.finished and stop:
            self._finish("stop", None)
        if not self.finished and len(self.token_ids) >= self.max_tokens:
            self._finish("length", None)
        return dataclasses.replace(self._delta([token], [logprob], [list(top)]), hidden_stop=hidden)

    def finish(self, reason: str) -> Delta:
        """End the sequence from outside (a search that stopped it, an abort); the held-back text is released."""
        if not self.finished:
            self._finish(reason, None)
        return self._delta([], [], [])

    def completion(self, prompt_ids: list[int], prompt_logprobs: PromptLogprobs | None = None,
                   prompt_text: str = "") -> Completion:
        """The finished sequence; with `echo` the prompt's text, ids and log-probs lead (NaN for the first)."""
        assert self.finished, "completion() of a running sequence"
        top_n = self.cfg.top_logprobs
        c = Completion(
            text=self.text,
            token_ids=list(self.token_ids),
            prompt_token_ids=list(prompt_ids),
            finish_reason="stop" if self.finish_reason == "stop" else "length",
            logprobs=list(self.logprobs),
            top_logprobs=[dict(t) for t in self.top_logprobs] if top_n else None,
            prompt_logprobs=[None if e is None else e[0] for e in prompt_logprobs] if prompt_logprobs else None,
            stop_reason=self.stop_reason,
            prompt_tokens=len(prompt_ids),
            completion_tokens=len(self.token_ids),
        )
        if not self.cfg.echo:
            return c
        head = [float("nan") if x is None else x for x in (c.prompt_logprobs or [None] * len(prompt_ids))]
        return dataclasses.replace(
            c, text=prompt_text + c.text, token_ids=c.prompt_token_ids + c.token_ids, logprobs=head + c.logprobs
        )

    # ---- internals ---------------------------------------------------------------------------------------------
    def _finish(self, reason: str, stop_reason: int | str | None) -> None:
        self.finish_reason, self.stop_reason = reason, stop_reason
        if not isinstance(stop_reason, str) and self.detokenizer is not None:
            self.text += self.detokenizer.flush()  # an unfinished character at the very end

    def _push_text(self, token: int) -> None:
        if self.detokenizer is not None:
            self.text += self.detokenizer.push(token)

    def _find_stop_string(self, search_from: int) -> None:
        hits = [(i, s) for s in self.stops if (i := self.text.find(s, search_from)) >= 0]
        if hits:
            at, stop = min(hits)
            self.text = self.text[: at + len(stop)] if self.cfg.include_stop_str_in_output else self.text[:at]
            self._finish("stop", stop)

    def _delta(self, tokens: list[int], logprobs: list[float], top: list[TopLogprobs]) -> Delta:
        held = 0 if self.finished else stop_string_holdback(self.text, self.stops)
        safe = len(self.text) - held
        text = self.text[self.streamed : safe] if safe > self.streamed else ""
        self.streamed = max(self.streamed, safe)
        return Delta(tokens, text, logprobs, top, self.finish_reason, self.stop_reason)


def replay(cfg: GenerationConfig, tokens: Sequence[int], logprobs: Sequence[float], detokenizer: Any,
           ended: bool) -> OutputPipeline:
    """A finished row of a search strategy (beams, contrastive) run through the pipeline after the fact: the
    same stop strings, stop ids, text and finish reasons as a decoded sequence. `ended`: the search stopped the
    row itself (e.g. a finished beam) rather than at the length budget."""
    out = OutputPipeline(cfg, len(tokens) + 1, detokenizer)  # the search decided the length
    for token, lp in zip(tokens, logprobs):
        if out.finished:
            break
        out.push(int(token), float(lp))
    out.finish("stop" if ended else "length")
    return out
