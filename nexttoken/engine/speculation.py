"""Speculative decoding in the engine: draft k tokens per request, verify them in one target pass, keep the agreed.

Losslessness rests on the verification. A request at length n with drafts d1..dk is verified as k + 1 decode rows
of its own slot: row i feeds token i (the last token, then the drafts) at column n - 1 + i and attends over the
first n + i columns. That is exactly the row the request's next single decode step would be, so the target's
logits at each position are the numbers plain decoding computes, bit for bit: on the fused native step each row
depends on itself alone (the step writes every row's K/V of a layer before any row attends, so row i sees rows
< i of its slot as it would have seen them cached), and on the modules path rows take the same key-length bucket
and padded group as a single step would (the runner's batch invariance). Each position then goes through the
request's own processors, chooser and output pipeline one token at a time, as `advance` does without
speculation; greedy keeps a draft while it equals the target's choice, sampling uses the rejection rule
(generation/speculative.py). K/V written for rejected drafts lie past the request's length and are overwritten
before they are read.

Draft tokens come from prompt lookup (the request's own ids) or a draft model with a KV cache of its own, one
slot per engine slot (`Drafter`); the draft's numbers need not match anything, only the target's do.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import GenerationConfigError, TensorParallelError
from ..generation.sampling import Sampler
from ..generation.speculative import DraftLength, accept_or_resample, prompt_lookup
from ..model import ForwardBatch, Transformer, fused, kernels
from ..model.kernels import MAX_ROWS
from .model_runner import ModelRunner, SlotView, check_cache_memory
from .postprocess import advance, advance_greedy, fail, plain_greedy, push_chosen
from .scheduler import StepPlan
from .sequence import Sequence, Speculation, TokenEvent

log = logging.getLogger("nexttoken.engine")

DEFAULT_NGRAM = 2  # transformers' max_matching_ngram_size default


@dataclass(frozen=True)
class SpeculativeConfig:
    """A server's speculation for every request that asks for none itself: a draft model, or prompt lookup."""

    num_tokens: int = 4  # tokens drafted per step
    draft_model: Transformer | None = None  # None: prompt lookup
    ngram: int = DEFAULT_NGRAM  # prompt lookup's longest n-gram


@dataclass(eq=False)
class VerifyRow:
    """One position of a verification, shaped as the runner's decode rows read a Sequence."""

    block_table: list[int]  # the request's KV blocks
    last_token: int  # the token fed at column num_tokens - 1
    num_tokens: int
    num_cached: int = 0
    rope_delta: int = 0  # M-RoPE: the request's position offset (Sequence.rope_delta)
    slot: int | None = None  # the request's place among the running: its recurrent state slot (hybrid models)

    def hook_inputs(self) -> dict:
        return {}


@dataclass
class Proposal:
    tokens: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] | None = None  # (V,) draft probabilities per token when sampled; None: deterministic


class Drafter:
    """A draft model with one cache slot per engine slot. `propose` runs every request's catch-up (the tokens it
    has not seen yet) and then k - 1 more single steps, batched across requests on the native step."""

    def __init__(self, model: Transformer, num_slots: int, max_len: int) -> None:
        self.model = model
        check_cache_memory(model, num_slots, max_len)
        self.cache = model.new_cache(num_slots, max_len)  # (L, slots, Hkv, max_len, D)

    @torch.inference_mode()
    def propose(self, wanted: list[tuple[Sequence, int]],
                drop: Callable[[Sequence, Exception], None]) -> dict[Sequence, Proposal]:
        """Each request's drafts; one whose processors raise on a draft position is handed to `drop` (it ends)
        and drafts no further."""
        out = {seq: Proposal(probs=None if seq.params.greedy else []) for seq, _ in wanted}
        # Catch-up: columns draft_cached .. n - 1; the last row's logits give the first draft.
        feeds = [(seq, seq.token_ids[seq.spec.draft_cached :], seq.spec.draft_cached) for seq, _ in wanted]
        for step in range(max(k for _, k in wanted)):
            logits = self._forward(feeds)
            for (seq, tokens, start), row in zip(feeds, logits):
                seq.spec.draft_cached = start + len(tokens)
                try:
                    self._choose(seq, row, out[seq])
                except Exception as e:  # noqa: BLE001 - this request ends; the others go on drafting
                    drop(seq, e)
                    out.pop(seq)
            wanted = [(seq, k) for seq, k in wanted if seq in out]
            feeds = [(seq, out[seq].tokens[-1:], seq.num_tokens + step) for seq, k in wanted if k > step + 1]
            if not feeds:
                break
        return out

    def _choose(self, seq: Sequence, logits: torch.Tensor, proposal: Proposal) -> None:
        """The draft's token from (V,) logits after the request's own processors (they apply to draft and
        target alike): its argmax when greedy, else a draw from its distribution with the request's generator."""
        scores = logits[None]
        if len(seq.processors):
            scores = seq.processors(torch.tensor([seq.token_ids + proposal.tokens]), scores)
        if proposal.probs is None:
            proposal.tokens.append(int(scores[0].argmax()))
            return
        probs = scores[0].softmax(-1)
        proposal.tokens.append(int(torch.multinomial(probs, 1, generator=seq.sampler.generator)))
        proposal.probs.append(probs)

    def _forward(self, feeds: list[tuple[Sequence, list[int], int]]) -> list[torch.Tensor]:
        """(V,) float32 logits after each feed's last token; feed = (seq, tokens, first column)."""
        plan = fused.rows_plan(self.model, self.cache)
        if plan is None:
            return [self._forward_modules(seq.slot, tokens, start) for seq, tokens, start in feeds]
        rows = [(seq.slot, t, start + j) for seq, tokens, start in feeds for j, t in enumerate(tokens)]
        logits = []
        for first in range(0, len(rows), MAX_ROWS):
            part = rows[first : first + MAX_ROWS]
            cols = torch.tensor([c for _, _, c in part])
            got = fused.decode_rows(plan, self.model, torch.tensor([[t] for _, t, _ in part]), cols,
                                    torch.tensor([s for s, _, _ in part]), cols + 1)
            assert got is not None, "rows_plan said the native step takes this model and cache"
            logits.append(got)
        every = torch.cat(logits)  # (rows, V)
        ends = torch.tensor([len(tokens) for _, tokens, _ in feeds]).cumsum(0) - 1
        return list(every[ends])

    def _forward_modules(self, slot: int, tokens: list[int], start: int) -> torch.Tensor:
        end = start + len(tokens)
        ids = torch.tensor([tokens])  # (1, T)
        cols = torch.arange(start, end)[None]  # (1, T) positions = cache columns
        valid = torch.ones(1, end, dtype=torch.bool)
        batch = ForwardBatch.build(cols, cols, valid, end, self.model.config.sliding_window, write_start=start)
        view = SlotView(self.cache.k[:, slot : slot + 1], self.cache.v[:, slot : slot + 1])
        return self.model(ids, batch, view).float()[0]  # (V,)


# Verification runs the runner's rows outside the step plan the ranks receive: not with tensor parallelism yet.
SPEC_TP = ("speculative decoding does not run on a tensor-parallel model yet: drop assistant_model / "
           "prompt_lookup_num_tokens (or --speculative-*), or load the model with tensor_parallel_size=1")


class Speculator:
    """The engine's speculation: which requests speculate and how (`setup`, at add_request: a request's own
    assistant model or prompt lookup, else the engine's `default`), the draft models' caches, the speculative rows
    of each step (`take`, then `run`: propose, verify in one target pass, accept per request) and the totals."""

    def __init__(self, runner: ModelRunner, num_slots: int = 1, default: SpeculativeConfig | None = None) -> None:
        self.runner, self.num_slots, self.default = runner, num_slots, default
        self.sharded = getattr(runner.model, "cluster", None) is not None
        if default is not None and self.sharded:
            raise GenerationConfigError(SPEC_TP)
        self._drafters: dict[int, Drafter] = {}  # id(draft model) -> its slot cache
        self._totals = [0, 0, 0]  # drafted, accepted, verification passes of finished requests
        if default is not None and default.draft_model is not None:
            self._drafter(default.draft_model)  # a draft it cannot serve is refused now, not at the first request

    # ---- set-up, per request -----------------------------------------------------------------------------------
    def setup(self, seq: Sequence, draft_model: Transformer | None) -> Speculation | None:
        """The request's speculation, or None without prompt lookup or a draft model; options it cannot serve
        exactly raise here."""
        params = seq.params
        lookup = params.prompt_lookup_num_tokens
        default = self.default
        if (draft_model is not None or lookup is not None) and self.sharded:
            raise GenerationConfigError(SPEC_TP)
        if draft_model is None and lookup is None and default is not None and _can_speculate(seq):
            if default.draft_model is not None:
                return Speculation(DraftLength(default.num_tokens), drafter=self._drafter(default.draft_model))
            return Speculation(DraftLength(default.num_tokens), ngram=default.ngram)
        if draft_model is None and lookup is None:
            if params.max_matching_ngram_size is not None:
                raise GenerationConfigError(
                    "max_matching_ngram_size sets prompt lookup's n-gram: set prompt_lookup_num_tokens too")
            return None
        if draft_model is not None and lookup is not None:
            raise GenerationConfigError(
                "a draft model (assistant_model) and prompt_lookup_num_tokens both propose draft tokens: use one")
        if not _can_speculate(seq):
            raise GenerationConfigError(
                "speculative decoding works with greedy decoding and sampling, without hooks, structured output, "
                "mirostat or a LoRA adapter: drop assistant_model / prompt_lookup_num_tokens for this request")
        if lookup is not None:
            return Speculation(DraftLength(lookup), ngram=params.max_matching_ngram_size or DEFAULT_NGRAM)
        return Speculation(DraftLength(params.num_assistant_tokens, params.num_assistant_tokens_schedule),
                           drafter=self._drafter(draft_model))

    def _drafter(self, draft: Transformer) -> Drafter:
        target = self.runner.model
        if not isinstance(draft, Transformer):
            raise GenerationConfigError(f"draft_model must be a nexttoken Transformer, got {type(draft).__name__}")
        if draft.config.vocab_size != target.config.vocab_size:
            raise GenerationConfigError(
                f"the draft model's vocabulary has {draft.config.vocab_size} tokens and this model's "
                f"{target.config.vocab_size}: a draft model must share the tokenizer")
        if draft.config.max_position_embeddings < self.runner.max_len:
            raise GenerationConfigError(
                f"the draft model's context ({draft.config.max_position_embeddings}) is shorter than this engine's "
                f"max_model_len ({self.runner.max_len}): use a draft with a context at least as long")
        if any(not draft.config.layer(i).keeps_kv for i in range(draft.config.num_hidden_layers)):
            raise GenerationConfigError(
                f"the draft model ({draft.config.architecture}) has layers that keep a recurrent state, which its "
                "slot cache does not hold: use a draft model whose layers are all attention, or prompt lookup")
        if id(draft) not in self._drafters:
            self._drafters[id(draft)] = Drafter(draft, self.num_slots, self.runner.max_len)
        return self._drafters[id(draft)]

    # ---- totals ------------------------------------------------------------------------------------------------
    def finished(self, seq: Sequence) -> None:
        """Count a finished request's drafts into the totals."""
        if seq.spec is not None:
            self._totals[0] += seq.spec.drafted
            self._totals[1] += seq.spec.accepted
            self._totals[2] += seq.spec.steps

    def totals(self, running: list[Sequence]) -> dict[str, int]:
        """EngineStats' speculation counters: the finished requests' and the running ones' so far."""
        live = [s.spec for s in running if s.spec is not None]
        return dict(
            spec_draft_tokens_total=self._totals[0] + sum(s.drafted for s in live),
            spec_accepted_tokens_total=self._totals[1] + sum(s.accepted for s in live),
            spec_steps_total=self._totals[2] + sum(s.steps for s in live),
        )

    # ---- the step ----------------------------------------------------------------------------------------------
    def take(self, plan: StepPlan) -> list[Sequence]:
        """The plan's speculative decode rows, taken out of it: they are verified apart (`run`)."""
        speculative = [s for s in plan.decode if s.spec is not None]
        if speculative:
            plan.decode = [s for s in plan.decode if s.spec is None]
        return speculative

    def run(self, seqs: list[Sequence]) -> list[TokenEvent]:
        """`step`, where a failing verification pass (shared by these requests) ends them with an error and the
        engine goes on; a tensor-parallel rank's failure goes up."""
        if not seqs:
            return []
        try:
            return self.step(seqs)
        except TensorParallelError:
            raise
        except Exception as e:  # noqa: BLE001 - the verification's shared forward: these requests end
            log.exception("a verification pass failed; its %d requests end with an error", len(seqs))
            return [fail(seq, e) for seq in seqs if seq.finish_reason is None]

    def step(self, seqs: list[Sequence]) -> list[TokenEvent]:
        """Each request's events. One whose own work raises (its processors or sampler on a draft or a verified
        position, its detokenizer) ends alone with finish_reason "error"; the others go on."""
        events: list[TokenEvent] = []
        failed: set[Sequence] = set()

        def drop(seq: Sequence, e: Exception) -> None:
            events.append(fail(seq, e))
            failed.add(seq)

        room = {seq: self._room(seq) for seq in seqs}
        proposals: dict[Sequence, Proposal] = {}
        by_drafter: dict[int, list[tuple[Sequence, int]]] = {}
        for seq in seqs:
            if seq.spec.drafter is not None and room[seq]:
                by_drafter.setdefault(id(seq.spec.drafter), []).append((seq, room[seq]))
            elif room[seq]:
                try:
                    proposals[seq] = Proposal(prompt_lookup(seq.token_ids, room[seq], seq.spec.ngram))
                except Exception as e:  # noqa: BLE001 - this request ends; the others go on
                    drop(seq, e)
        for wanted in by_drafter.values():
            proposals.update(wanted[0][0].spec.drafter.propose(wanted, drop))
        seqs = [seq for seq in seqs if seq not in failed]
        rows = {seq: [VerifyRow(seq.block_table, t, seq.num_tokens + i, rope_delta=seq.rope_delta,
                                slot=seq.slot)
                      for i, t in enumerate([seq.last_token] + proposals.get(seq, Proposal()).tokens)] for seq in seqs}
        logits = self.runner.verify([r for seq in seqs for r in rows[seq]])  # (rows, V)
        first = 0
        for seq in seqs:
            n, fed = len(rows[seq]), seq.num_tokens
            try:
                events += self._accept(seq, logits[first : first + n], proposals.get(seq, Proposal()))
            except Exception as e:  # noqa: BLE001 - this request ends (its tokens so far stand); the others go on
                drop(seq, e)
            # a recurrent state goes back to the one after the last kept draft (row num_cached - fed)
            self.runner.rollback(seq.slot, seq.num_cached - fed)
            first += n
        return events

    def _room(self, seq: Sequence) -> int:
        """Draft tokens worth verifying: the schedule's, within the output budget (one token is the target's own),
        the request's columns and the KV blocks the pool can give it now (never preempting for drafts)."""
        left = seq.max_tokens - len(seq.output_ids) - 1
        k = max(0, min(seq.spec.length.num_tokens, left, self.runner.max_len - seq.num_tokens))
        return min(k, self.runner.blocks.grow_up_to(seq, seq.num_tokens + k) - seq.num_tokens)

    def _accept(self, seq: Sequence, logits: torch.Tensor, proposal: Proposal) -> list[TokenEvent]:
        """Push the target's tokens for positions 0..k in order until one differs from the draft (greedy) or is
        rejected (sampling), or the request finishes. logits: (k + 1, V)."""
        spec, drafts, events, kept = seq.spec, proposal.tokens, [], 0
        spec.steps += 1
        spec.drafted += len(drafts)
        if seq.params.greedy and plain_greedy(seq) and seq.grammar is None:
            events, kept = _accept_greedy(seq, logits, drafts)
        for i in range(len(drafts) + 1 if not events else 0):
            draft = drafts[i] if i < len(drafts) else None
            choice: dict[str, bool] = {}
            if seq.params.greedy or draft is None:
                event = advance_greedy([seq], logits[i : i + 1])[0] if plain_greedy(seq) else advance(seq, logits[i : i + 1])
                choice["kept"] = draft is not None and event.token_ids[-1] == draft
            else:
                q = None if proposal.probs is None else proposal.probs[i]
                event = advance(seq, logits[i : i + 1], chooser=_rejection(seq, q, draft, choice))
            events.append(event)
            if seq.trace is not None:  # the page lists it beside the step's stop decisions
                seq.trace.note("speculative", {
                    "source": "prompt lookup" if spec.drafter is None else "draft model", "position": i,
                    "drafts": len(drafts), "draft": draft, "kept": choice["kept"]})
            if not choice["kept"] or event.finish_reason is not None:
                break
            kept += 1
        spec.accepted += kept
        spec.length.update(len(drafts), kept)
        counts = dict(spec_draft_tokens=spec.drafted, spec_accepted_tokens=spec.accepted)
        events = [dataclasses.replace(e, **counts) for e in events]  # the step's events carry its counts
        seq.num_cached = seq.num_tokens - 1  # the drafts kept are in the cache; the target's own token is not
        spec.draft_cached = min(spec.draft_cached, seq.num_tokens - 1)  # the draft's columns past it held rejects
        return events


def _can_speculate(seq: Sequence) -> bool:
    return seq.lora is None and not seq.hooks and seq.grammar is None and isinstance(seq.sampler, Sampler)


def _accept_greedy(seq: Sequence, logits: torch.Tensor, drafts: list[int]) -> tuple[list[TokenEvent], int]:
    """`advance_greedy` for one plain greedy request's k + 1 positions at once: one argmax and one log-softmax
    over the (k + 1, V) logits (each row's numbers are its own, so they are what k + 1 single calls give), then
    the tokens pushed in order until one differs from the draft or the request finishes. At ~0.1 ms a target
    step (the packaged model) the per-position calls cost about as much as the verification itself."""
    tokens = kernels.argmax(logits).tolist()
    logp = torch.log_softmax(logits, dim=-1)  # (k + 1, V): the raw distribution
    chosen = logp.gather(1, torch.tensor(tokens)[:, None]).squeeze(1).tolist()
    now, events, kept = time.monotonic(), [], 0
    for i, token in enumerate(tokens):
        events.append(push_chosen(seq, token, chosen[i], logp[i], now))
        if i == len(drafts) or token != drafts[i] or events[-1].finish_reason is not None:
            break
        kept += 1
    return events, kept


def _rejection(seq: Sequence, q: torch.Tensor | None, draft: int, choice: dict[str, bool]):  # noqa: ANN202
    def choose(scores: torch.Tensor) -> int:  # (1, V) processed scores
        token, choice["kept"] = accept_or_resample(scores[0].softmax(-1), q, draft, seq.sampler.generator)
        return token

    return choose
