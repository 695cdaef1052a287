"""Generation traces: why each token came out. Recorded per step for one request when `GenerationConfig.trace`.

A step's record holds what the engine's choice did, stage by stage, on the (V,) row of that request:

- `raw`: the model's top-N tokens (ids, logits, probabilities) and its entropy;
- `stages`: for each processor in the chain, in order, its name, how many tokens it changed or masked, the
  tokens whose probability moved most, the probability mass it moved (total variation distance), the entropy
  before and after, and the top-N after it;
- `chosen`: the token with its rank and probability under the final scores (and under the raw logits);
- `sampler`: greedy or a draw, the seed and a digest of the generator's state before the draw;
- `stop`: each stop condition's decision; `ms`: the step's timings (forward, each processor, sampling, stop);
- `notes`: other decisions a step's code adds with `TraceRecorder.note` (speculation, for one).

Memory is bounded by `trace_top_n`: no (V,) tensor is kept. The recorder is only ever built for a traced
request, so an untraced step runs exactly the operations it ran before tracing existed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from typing import Any, Callable, Sequence

import torch

TRACE_VERSION = 1


def processor_name(p: Any) -> str:
    """A processor's name as the trace shows it: its class (a function's own name)."""
    return getattr(p, "__name__", None) or type(p).__name__


def distribution(scores: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(V,) scores -> (V,) float64 probabilities and the entropy in nats (0 log 0 = 0)."""
    probs = torch.softmax(scores.double(), dim=-1)
    return probs, float(torch.special.entr(probs).sum())


def top_candidates(scores: torch.Tensor, probs: torch.Tensor, n: int) -> dict[str, list]:
    """The n most likely tokens, best first (ties by the lower id), masked ones (-inf) left out: ids, scores and
    probabilities."""
    n = min(n, int((scores > -torch.inf).sum()))
    order = torch.argsort(scores, descending=True, stable=True)[:n]
    return {"ids": order.tolist(), "logits": _floats(scores[order]), "probs": _floats(probs[order])}


def stage_record(name: str, before: torch.Tensor, after: torch.Tensor, p_before: torch.Tensor,
                 p_after: torch.Tensor, h_before: float, h_after: float, n: int, seconds: float) -> dict[str, Any]:
    """What one processor did to a (V,) row: changed and masked tokens, mass moved, entropy, top-N after it."""
    same = (before == after) | (before.isnan() & after.isnan())  # -inf == -inf counts as unchanged
    masked = torch.isfinite(before) & (after == -torch.inf)
    moved = (p_after - p_before).abs()
    changed_ids = torch.nonzero(~same).flatten()
    biggest = changed_ids[torch.argsort(moved[changed_ids], descending=True, stable=True)[:n]]
    return {
        "name": name,
        "changed": int((~same).sum()),
        "masked": int(masked.sum()),
        "mass_moved": 0.5 * float(moved.sum()),
        "entropy_before": h_before,
        "entropy_after": h_after,
        "moved": [{"id": int(i), "before": float(p_before[i]), "after": float(p_after[i]),
                   "logit_before": _float(before[i]), "logit_after": _float(after[i])} for i in biggest.tolist()],
        "top": top_candidates(after, p_after, n),
        "ms": seconds * 1e3,
    }


def generator_digest(generator: torch.Generator | None) -> str | None:
    """A short digest of a generator's full state: equal digests, equal future draws."""
    if generator is None:
        return None
    return hashlib.sha256(generator.get_state().numpy().tobytes()).hexdigest()[:16]


class TraceRecorder:
    """One request's trace, filled by the engine's `advance` one step at a time.

    `decode` turns one id into its text for the page (None: ids only). `meta` is what replay needs to run the
    request again: the prompt ids and the options (GenerationConfig's values).
    """

    def __init__(self, top_n: int, meta: dict[str, Any], decode: Callable[[int], str] | None = None) -> None:
        self.top_n, self.meta, self.decode = top_n, meta, decode
        self.steps: list[dict[str, Any]] = []
        self._forward_s = 0.0
        self._text_length = 0  # characters of the output pipeline's text already given to a step

    def forward_done(self, seconds: float) -> None:
        """The time of the forward pass this step's logits came from (the whole batch's)."""
        self._forward_s = seconds

    def choose(self, processors: Sequence[Any], sampler: Any, ids: torch.Tensor | None,
               logits: torch.Tensor, chooser: Callable[[torch.Tensor], int] | None = None) -> tuple[torch.Tensor, int]:
        """Run the chain processor by processor and the sampler, as ProcessorChain and advance would, recording
        each; (1, V) processed scores and the chosen id. The calls are the same, in the same order, on the same
        inputs, so the chosen token is the one an untraced run chooses. `chooser` (speculative decoding's
        rejection rule, drawing from the sampler's generator) replaces the sampler's draw, as in advance."""
        n = self.top_n
        raw = logits[0].detach().float()  # (V,) read, never written
        p_raw, h_raw = distribution(raw)
        step: dict[str, Any] = {"index": len(self.steps), "raw": {**top_candidates(raw, p_raw, n), "entropy": h_raw}}
        scores, row, probs, entropy, stages = logits, raw, p_raw, h_raw, []
        for p in processors:
            start = time.perf_counter()
            scores = p(ids, scores)
            seconds = time.perf_counter() - start
            after = scores[0].detach().float()  # (V,): a processor that runs the model (guidance) may track grads
            p_after, h_after = distribution(after)
            stages.append(stage_record(processor_name(p), row, after, probs, p_after, entropy, h_after, n, seconds))
            row, probs, entropy = after, p_after, h_after
        generator = getattr(sampler, "generator", None)
        digest = generator_digest(generator)
        start = time.perf_counter()
        token = int(sampler(scores)[0]) if chooser is None else chooser(scores)
        sample_s = time.perf_counter() - start
        step["stages"] = stages
        step["final"] = {**top_candidates(row, probs, n), "entropy": entropy}
        step["chosen"] = {
            "id": token,
            "rank": int((row > row[token]).sum()) + 1,
            "prob": float(probs[token]),
            "logit": _float(row[token]),
            "raw_rank": int((raw > raw[token]).sum()) + 1,
            "raw_prob": float(p_raw[token]),
        }
        step["sampler"] = {
            "kind": type(sampler).__name__ if chooser is None else "speculative rejection rule",
            "greedy": bool(getattr(sampler, "greedy", False)),
            "seed": None if generator is None else int(generator.initial_seed()),
            "state": digest,
        }
        step["ms"] = {"forward": self._forward_s * 1e3, "processors": sum(s["ms"] for s in stages),
                      "sampling": sample_s * 1e3}
        self.steps.append(step)
        return scores, token

    def note(self, name: str, decision: Any) -> None:
        """Another per-step decision for this step (JSON-ready: e.g. a speculative draft's accepted length); the
        page lists it under the stop decisions."""
        self.steps[-1].setdefault("notes", {})[name] = decision

    def criteria(self, chain: Any, ids: torch.Tensor, scores: torch.Tensor) -> bool:
        """A caller's stopping criteria, each called once (as StoppingChain does) and its answer recorded."""
        done, decisions = False, []
        for criterion in chain.criteria:
            said = bool(torch.as_tensor(criterion(ids, scores), dtype=torch.bool).flatten()[0])
            decisions.append({"name": processor_name(criterion), "stop": said})
            done = done or said
        self.steps[-1]["criteria"] = decisions
        return done

    def stopped(self, out: Any, token: int, seconds: float) -> None:
        """The output pipeline's stop conditions for this step's token (`out`: the OutputPipeline after push)."""
        n_out = len(out.token_ids)
        may_stop = n_out >= out.min_tokens
        reason, stop_reason = out.finish_reason, out.stop_reason
        decisions = [
            {"name": "min_new_tokens", "stop": False, "detail": f"{n_out} of at least {out.min_tokens} tokens"
             + ("" if may_stop else ": stops held back")},
            {"name": "stop_token_ids", "stop": may_stop and token in out.stop_token_ids},
            {"name": "eos", "stop": may_stop and token in out.stop_ids and token not in out.stop_token_ids},
            {"name": "stop_strings", "stop": isinstance(stop_reason, str), "detail": stop_reason
             if isinstance(stop_reason, str) else None},
            *({**c, "name": f"criterion:{c['name']}"} for c in self.steps[-1].get("criteria", [])),
            {"name": "max_tokens", "stop": n_out >= out.max_tokens, "detail": f"{n_out} of {out.max_tokens}"},
        ]
        step = self.steps[-1]
        step["text"] = out.text[self._text_length:]  # the text this token added, read in context
        self._text_length = max(self._text_length, len(out.text))
        step["stop"] = decisions
        step["finish_reason"] = reason
        step["ms"]["stop"] = seconds * 1e3

    def to_dict(self, output: dict[str, Any] | None = None) -> dict[str, Any]:
        """The trace as JSON-ready data: the request (for replay), the steps, the token texts the page shows."""
        seen = set(self.meta.get("prompt_ids", []))
        for step in self.steps:
            seen.add(step["chosen"]["id"])
            for part in (step["raw"], step["final"], *(s["top"] for s in step["stages"])):
                seen.update(part["ids"])
            for s in step["stages"]:
                seen.update(m["id"] for m in s["moved"])
        texts = {str(i): self.decode(i) for i in sorted(seen)} if self.decode is not None else {}
        return {"version": TRACE_VERSION, **self.meta, "top_n": self.top_n, "steps": self.steps,
                "token_texts": texts, **(output or {})}


def request_recorder(params: Any, prompt_ids: list[int], max_tokens: int, tokenizer: Any,
                     engine: dict[str, Any]) -> "TraceRecorder":
    """The recorder of one traced engine request: what it was asked (prompt, options, length budget) and, under
    `engine` (the engine's chunk size, cache dtype, model dtype and device), what else decides the logits' last
    bits, with the threads and torch's version: a replay elsewhere names the ones that differ."""
    decode = None if tokenizer is None else (lambda i: tokenizer.decode([i], skip_special_tokens=False))
    facts = {"chunk_size": engine["chunk_size"], "kv_cache_dtype": engine["kv_cache_dtype"],
             "threads": torch.get_num_threads(), "dtype": engine["dtype"], "device": engine["device"],
             "torch": torch.__version__}
    meta = {"prompt_ids": list(prompt_ids), "options": options_of(params), "max_tokens": max_tokens,
            "prompt_text": None if tokenizer is None else tokenizer.decode(prompt_ids, skip_special_tokens=False),
            "engine": facts}
    return TraceRecorder(params.trace_top_n, meta, decode)


def options_of(cfg: Any) -> dict[str, Any]:
    """A GenerationConfig's values that differ from the defaults, as JSON can hold them (replay's options)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if value == f.default or f.name in ("trace", "trace_top_n"):
            continue
        if isinstance(value, dict) and value and isinstance(next(iter(value)), tuple):  # sequence_bias
            value = [[list(k), v] for k, v in value.items()]
        elif dataclasses.is_dataclass(value):
            value = dataclasses.asdict(value)
        elif isinstance(value, tuple):
            value = list(value)
        out[f.name] = value
    return out


def to_json(trace: dict[str, Any], indent: int | None = None) -> str:
    """The trace as strict JSON: a non-finite number (a masked token's score, the entropy of nothing) is null."""
    def clean(x: Any) -> Any:
        if isinstance(x, float):
            return x if x == x and x not in (float("inf"), float("-inf")) else None
        if isinstance(x, dict):
            return {str(k): clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    return json.dumps(clean(trace), indent=indent, allow_nan=False)


def _float(x: torch.Tensor) -> float | None:
    """A score as JSON can hold it: -inf (a masked token) becomes None."""
    v = float(x)
    return None if v != v or v in (float("inf"), float("-inf")) else v


def _floats(xs: torch.Tensor) -> list[float | None]:
    return [_float(x) for x in xs]
