"""Replay: run a traced request again and say whether it came out the same, and if not, where and why.

A trace holds the request (prompt ids, every option that differs from the defaults, the seed the sampler was
started from) and, per step, what the model and each processor did to the top-N. Running it again with tracing on
gives a second trace; `compare` walks both, step by step and stage by stage, and reports the first difference:
the model's logits (weights, dtype, kernels), the processor chain (an option added or removed), one processor's
output (an option's value or the processor's code), the sampler (its generator state or its draw), or a stop
decision. Numbers are compared exactly: a replay on the same model, options and code is identical bit for bit.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from ...errors import GenerationConfigError
from ..config import GenerationConfig
from .recorder import to_json


@dataclass(frozen=True)
class Divergence:
    step: int  # the first generated token (0-based) where the runs differ
    where: str  # "model", "chain", "processor", "sampler", "stop" or "length"
    name: str | None  # the processor (or stop condition) whose output differs
    detail: str


@dataclass(frozen=True)
class ReplayReport:
    steps: int  # steps compared
    divergence: Divergence | None

    @property
    def identical(self) -> bool:
        return self.divergence is None

    def summary(self) -> str:
        if self.divergence is None:
            return f"identical: {self.steps} steps, the same tokens, candidates, draws and stop decisions"
        d = self.divergence
        return f"diverged at step {d.step} ({d.where}{': ' + d.name if d.name else ''}): {d.detail}"


def replay_options(trace: dict[str, Any], defaults: GenerationConfig | None = None) -> dict[str, Any]:
    """The options to run the traced request with again, as keyword options over `defaults` (the model's
    generation defaults that a library call starts from): every value of the recorded config that differs from
    them, the sampler's seed pinned."""
    if trace.get("version") != 1 or "steps" not in trace or "prompt_ids" not in trace:
        raise GenerationConfigError("this is not a nexttoken trace (version 1): write one with trace=True, "
                                    "`nexttoken generate --trace out.html` or the server's `trace` field")
    options = dict(trace.get("options") or {})
    if isinstance(options.get("logit_bias"), dict):  # JSON keys are strings
        options["logit_bias"] = {int(k): v for k, v in options["logit_bias"].items()}
    first = trace["steps"][0]["sampler"] if trace["steps"] else {}
    if options.get("seed") is None and first.get("seed") is not None:
        options["seed"] = first["seed"]  # an unseeded draw: the seed its generator was started from
    recorded = GenerationConfig().updated(**options)  # the trace holds the values that differ from these
    base = defaults or GenerationConfig()
    differ = {f.name: getattr(recorded, f.name) for f in dataclasses.fields(GenerationConfig)
              if getattr(recorded, f.name) != getattr(base, f.name)}
    return {**differ, "trace": True, "trace_top_n": trace["top_n"]}


def replay(trace: dict[str, Any], llm: Any, overrides: dict[str, Any] | None = None) -> tuple[ReplayReport, dict]:
    """Run the traced request again on `llm` (an LLM; `overrides` change options) -> (report, the new trace)."""
    options = {**replay_options(trace, getattr(llm, "generation_config", None)), **(overrides or {})}
    completion = llm.generate(list(trace["prompt_ids"]), **options)
    return compare(trace, completion.trace), completion.trace


def compare(recorded: dict[str, Any], fresh: dict[str, Any]) -> ReplayReport:
    """The first step and stage where two traces of one request differ (None: identical)."""
    recorded, fresh = json.loads(to_json(recorded)), json.loads(to_json(fresh))  # both as a trace file holds them
    a_steps, b_steps = recorded["steps"], fresh["steps"]
    for i, (a, b) in enumerate(zip(a_steps, b_steps)):
        found = _compare_step(i, a, b)
        if found is not None and found.where == "model":
            found = dataclasses.replace(found, detail=found.detail + _setting_changes(recorded, fresh))
        if found is not None:
            return ReplayReport(i + 1, found)
    n = min(len(a_steps), len(b_steps))
    if len(a_steps) != len(b_steps):
        return ReplayReport(n, Divergence(n, "length", None, f"the recorded run made {len(a_steps)} tokens, this one "
                                                              f"{len(b_steps)}"))
    return ReplayReport(n, None)


def _same(x: Any, y: Any) -> bool:
    return x == y  # JSON-read floats compare exactly: equal bits print equal


def _compare_step(i: int, a: dict, b: dict) -> Divergence | None:
    if not _same(a["raw"], b["raw"]):
        return Divergence(i, "model", None, "the model's logits differ (weights, dtype, kernels or the prompt "
                          f"changed): top ids {a['raw']['ids']} -> {b['raw']['ids']}, logits "
                          f"{_head(a['raw']['logits'])} -> {_head(b['raw']['logits'])}")
    names_a, names_b = [s["name"] for s in a["stages"]], [s["name"] for s in b["stages"]]
    for k, (sa, sb) in enumerate(zip(a["stages"], b["stages"])):
        if sa["name"] != sb["name"]:
            return Divergence(i, "chain", sb["name"], f"the processor chain differs at position {k}: recorded "
                              f"{names_a}, now {names_b}")
        if not all(_same(sa[key], sb[key]) for key in ("changed", "masked", "mass_moved", "entropy_after", "top")):
            return Divergence(i, "processor", sa["name"], f"{sa['name']}'s output differs: top ids "
                              f"{sa['top']['ids']} -> {sb['top']['ids']}, probabilities {_head(sa['top']['probs'])} "
                              f"-> {_head(sb['top']['probs'])}, changed {sa['changed']} -> {sb['changed']}, "
                              f"masked {sa['masked']} -> {sb['masked']}")
    if names_a != names_b:
        return Divergence(i, "chain", None, f"the processor chain differs: recorded {names_a}, now {names_b}")
    sa, sb = a["sampler"], b["sampler"]
    if (sa["kind"], sa["greedy"], sa["seed"], sa["state"]) != (sb["kind"], sb["greedy"], sb["seed"], sb["state"]):
        return Divergence(i, "sampler", sa["kind"], f"the sampler differs: {_sampler(sa)} -> {_sampler(sb)}")
    if a["chosen"] != b["chosen"]:
        return Divergence(i, "sampler", sa["kind"], f"the same scores and generator state drew token "
                          f"{b['chosen']['id']}, recorded {a['chosen']['id']}")
    for da, db in zip(a.get("stop", []), b.get("stop", [])):
        if da != db:
            return Divergence(i, "stop", da["name"], f"the stop decision differs: {da} -> {db}")
    if len(a.get("stop", [])) != len(b.get("stop", [])):
        return Divergence(i, "stop", None, "the stop conditions differ: "
                          f"{[d['name'] for d in a.get('stop', [])]} -> {[d['name'] for d in b.get('stop', [])]}")
    return None


def _setting_changes(a: dict[str, Any], b: dict[str, Any]) -> str:
    """The recorded engine settings (prefill chunk, threads, dtype, device, torch) that differ, as a sentence."""
    ea, eb = a.get("engine") or {}, b.get("engine") or {}
    changed = [f"{k} {ea.get(k)} -> {eb.get(k)}" for k in sorted(set(ea) | set(eb)) if ea.get(k) != eb.get(k)]
    return f"; settings that differ: {', '.join(changed)}" if changed else ""


def _head(xs: list, n: int = 3) -> str:
    return "[" + ", ".join("-inf" if x is None else f"{x:.6g}" for x in xs[:n]) + (", ...]" if len(xs) > n else "]")


def _sampler(s: dict) -> str:
    kind = "argmax" if s["greedy"] else "a draw"
    return f"{s['kind']} ({kind}, seed {s['seed']}, generator state {s['state']})"
