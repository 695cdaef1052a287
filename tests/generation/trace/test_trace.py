"""Generation traces: the numbers against an independent recomputation (transformers' logits on the same weights,
the processors applied by hand), exact replay and its divergence reports, the options, the CLI, and an operation
count showing that an untraced step runs exactly what it ran before tracing existed."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import nexttoken
from nexttoken.engine import llm_engine, postprocess
from nexttoken.engine.postprocess import snapshot
from nexttoken.engine.sequence import HookState, Sequence
from nexttoken.errors import GenerationConfigError
from nexttoken.generation.decode import StepOutput
from nexttoken.generation.trace.replay import compare, replay
from nexttoken.generation.sampling import Sampler
from nexttoken.generation.trace.recorder import to_json
from support.tiny_models import save_variant

PROMPT = [1, 5, 17, 33, 8]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(LLM, transformers model) on the same random weights."""
    folder = tmp_path_factory.mktemp("tiny-trace")
    hf = save_variant("llama-gqa", folder)
    return nexttoken.load(folder), hf


# ---- the numbers, recomputed by hand ---------------------------------------------------------------------------

def _repetition(scores: torch.Tensor, ids: list[int], penalty: float) -> torch.Tensor:
    out = scores.clone()
    for t in set(ids):
        out[t] = out[t] * penalty if out[t] < 0 else out[t] / penalty
    return out


def _top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    kth = torch.sort(scores, descending=True).values[k - 1]
    return scores.masked_fill(scores < kth, -math.inf)


def _top_p(scores: torch.Tensor, p: float) -> torch.Tensor:
    """The smallest set of most likely tokens whose mass reaches p (the one that crosses p included)."""
    probs = torch.softmax(scores.double(), -1)
    order = torch.argsort(probs, descending=True)
    keep, mass = set(), 0.0
    for t in order.tolist():
        keep.add(t)
        mass += float(probs[t])
        if mass >= p:
            break
    out = torch.full_like(scores, -math.inf)
    idx = torch.tensor(sorted(keep))
    out[idx] = scores[idx]
    return out


def _min_p(scores: torch.Tensor, p: float) -> torch.Tensor:
    probs = torch.softmax(scores.double(), -1)
    return scores.masked_fill(probs < p * probs.max(), -math.inf)


def _hand_chain(opts: dict) -> list[tuple[str, object]]:
    """transformers' order: repetition penalty, then (sampling only) temperature, top-k, top-p, min-p."""
    chain: list[tuple[str, object]] = []
    if opts.get("repetition_penalty", 1.0) != 1.0:
        chain.append(("RepetitionPenalty", lambda s, ids: _repetition(s, ids, opts["repetition_penalty"])))
    if opts.get("do_sample"):
        if opts.get("temperature", 1.0) != 1.0:
            chain.append(("Temperature", lambda s, ids: s / opts["temperature"]))
        if opts.get("top_k"):
            chain.append(("TopK", lambda s, ids: _top_k(s, opts["top_k"])))
        if opts.get("top_p", 1.0) < 1.0:
            chain.append(("TopP", lambda s, ids: _top_p(s, opts["top_p"])))
        if opts.get("min_p") is not None:
            chain.append(("MinP", lambda s, ids: _min_p(s, opts["min_p"])))
    return chain


def _entropy(probs: torch.Tensor) -> float:
    p = probs[probs > 0]
    return float(-(p * p.log()).sum())


def _check_candidates(recorded: dict, scores: torch.Tensor, n: int) -> None:
    """A recorded top-N against scores recomputed by hand: the same ids (as a set: float ties may order apart),
    each one's probability and score."""
    probs = torch.softmax(scores.double(), -1)
    finite = int(torch.isfinite(scores).sum())
    expected = torch.argsort(scores, descending=True)[: min(n, finite)].tolist()
    assert set(recorded["ids"]) == set(expected)
    for i, p, logit in zip(recorded["ids"], recorded["probs"], recorded["logits"]):
        assert p == pytest.approx(float(probs[i]), abs=2e-5)
        assert logit == pytest.approx(float(scores[i]), abs=2e-4)


GRID = [
    dict(do_sample=False, top_k=None),
    dict(do_sample=False, top_k=None, repetition_penalty=1.3),
    dict(do_sample=True, temperature=0.7, top_k=None, seed=11),
    dict(do_sample=True, top_k=5, seed=12),
    dict(do_sample=True, temperature=1.3, top_k=None, top_p=0.8, seed=13),
    dict(do_sample=True, repetition_penalty=1.2, top_k=20, min_p=0.1, temperature=0.9, seed=14),
]


@pytest.mark.parametrize("opts", GRID, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_trace_equals_a_recomputation_by_hand(tiny, opts) -> None:
    llm, hf = tiny
    n = 6
    c = llm.generate(PROMPT, max_new_tokens=8, trace=True, trace_top_n=n, **opts)
    trace = c.trace
    assert [s["chosen"]["id"] for s in trace["steps"]] == c.token_ids
    chain = _hand_chain(opts)
    for t, step in enumerate(trace["steps"]):
        ids = PROMPT + c.token_ids[:t]
        with torch.no_grad():
            raw = hf(torch.tensor([ids])).logits[0, -1].float()
        _check_candidates(step["raw"], raw, n)
        assert step["raw"]["entropy"] == pytest.approx(_entropy(torch.softmax(raw.double(), -1)), abs=1e-5)
        assert [s["name"] for s in step["stages"]] == [name for name, _ in chain]
        scores = raw
        for (name, apply), stage in zip(chain, step["stages"]):
            after = apply(scores, ids)
            p0, p1 = torch.softmax(scores.double(), -1), torch.softmax(after.double(), -1)
            _check_candidates(stage["top"], after, n)
            assert stage["masked"] == int((torch.isfinite(scores) & ~torch.isfinite(after)).sum()), name
            assert stage["mass_moved"] == pytest.approx(0.5 * float((p1 - p0).abs().sum()), abs=2e-5), name
            assert stage["entropy_before"] == pytest.approx(_entropy(p0), abs=1e-5)
            assert stage["entropy_after"] == pytest.approx(_entropy(p1), abs=1e-5)
            scores = after
        final = torch.softmax(scores.double(), -1)
        token = step["chosen"]["id"]
        assert step["chosen"]["prob"] == pytest.approx(float(final[token]), abs=2e-5)
        assert step["chosen"]["rank"] == int((scores > scores[token]).sum()) + 1
        if not opts["do_sample"]:
            assert token == int(scores.argmax()) and step["chosen"]["rank"] == 1
            assert step["sampler"]["greedy"] and step["sampler"]["state"] is None
        else:
            assert final[token] > 0 and step["sampler"]["seed"] == opts["seed"]
        assert step["stop"][-1] == {"name": "max_tokens", "stop": t == 7, "detail": f"{t + 1} of 8"}


def test_untraced_output_is_unchanged_by_tracing(tiny) -> None:
    llm, _ = tiny
    for opts in GRID:
        plain = llm.generate(PROMPT, max_new_tokens=10, **opts)
        traced = llm.generate(PROMPT, max_new_tokens=10, trace=True, **opts)
        assert traced.token_ids == plain.token_ids and traced.logprobs == plain.logprobs
        assert plain.trace is None


def test_stop_decisions_and_timings(tiny) -> None:
    llm, _ = tiny
    plain = llm.generate(PROMPT, max_new_tokens=6)
    stop_id = plain.token_ids[3]
    c = llm.generate(PROMPT, max_new_tokens=6, stop_token_ids=[stop_id], trace=True)
    last = c.trace["steps"][-1]
    assert len(c.trace["steps"]) == plain.token_ids.index(stop_id) + 1
    assert {d["name"]: d["stop"] for d in last["stop"]}["stop_token_ids"] is True
    assert c.trace["finish_reason"] == "stop" and c.trace["stop_reason"] == stop_id
    for step in c.trace["steps"]:
        assert set(step["ms"]) == {"forward", "processors", "sampling", "stop"}
        assert all(v >= 0 for v in step["ms"].values()) and step["ms"]["forward"] > 0


def test_trace_options_are_validated(tiny) -> None:
    llm, _ = tiny
    for bad in (dict(trace="yes"), dict(trace_top_n=0), dict(trace_top_n=10**6), dict(trace_top_n=2.5)):
        with pytest.raises(GenerationConfigError, match="trace"):
            llm.generate(PROMPT, max_new_tokens=2, **bad)
    with pytest.raises(GenerationConfigError, match="trace is recorded by the engine"):
        llm.generate(PROMPT, max_new_tokens=2, num_beams=2, trace=True)
    with pytest.raises(GenerationConfigError, match="nowhere to put a trace"):
        list(nexttoken.load().stream("Once", max_new_tokens=2, trace=True))
    c = llm.generate(PROMPT, max_new_tokens=3, trace=True, trace_top_n=3)
    assert all(len(s["raw"]["ids"]) == 3 for s in c.trace["steps"])  # bounded by N


# ---- replay ------------------------------------------------------------------------------------------------------

def _without_timings(trace: dict) -> dict:
    out = json.loads(to_json(trace))
    for step in out["steps"]:
        step.pop("ms")
        for stage in step["stages"]:
            stage.pop("ms")
    return out


@pytest.mark.parametrize("opts", [dict(do_sample=False), dict(do_sample=True, temperature=0.8, top_k=10, seed=5),
                                  dict(do_sample=True, top_p=0.9, top_k=None)],  # unseeded: the trace names its seed
                         ids=["greedy", "seeded", "unseeded"])
def test_replay_is_bit_for_bit(tiny, tmp_path, opts) -> None:
    llm, _ = tiny
    c = llm.generate(PROMPT, max_new_tokens=12, trace=True, **opts)
    path = tmp_path / "trace.json"
    path.write_text(to_json(c.trace))
    recorded = json.loads(path.read_text())
    report, fresh = replay(recorded, llm)
    assert report.identical, report.summary()
    assert _without_timings(fresh) == _without_timings(recorded)
    assert fresh["output_ids"] == c.token_ids


def test_replay_finds_a_changed_option(tiny) -> None:
    llm, _ = tiny
    trace = llm.generate(PROMPT, max_new_tokens=10, do_sample=True, temperature=0.9, top_k=12, seed=3, trace=True).trace
    report, _ = replay(trace, llm, {"top_k": 4})
    d = report.divergence
    assert d is not None and (d.step, d.where, d.name) == (0, "processor", "TopK"), report.summary()
    report, _ = replay(trace, llm, {"top_p": 0.5})  # a processor the recorded run did not have
    assert report.divergence.where == "chain" and report.divergence.step == 0, report.summary()
    report, _ = replay(trace, llm, {"seed": 4})
    assert (report.divergence.where, report.divergence.step) == ("sampler", 0), report.summary()


def test_replay_finds_changed_code(tiny, monkeypatch) -> None:
    """A processor whose code changed (top-k keeping one token more) is named at the first step it matters."""
    llm, _ = tiny
    trace = llm.generate(PROMPT, max_new_tokens=6, do_sample=True, temperature=0.9, top_k=8, seed=2, trace=True).trace
    from nexttoken.generation.processors import warpers

    original = warpers.TopK.__call__

    def one_more(self, input_ids, scores):  # noqa: ANN001, ANN202
        self.top_k += 1
        try:
            return original(self, input_ids, scores)
        finally:
            self.top_k -= 1

    monkeypatch.setattr(warpers.TopK, "__call__", one_more)
    report, _ = replay(trace, llm)
    assert (report.divergence.step, report.divergence.where, report.divergence.name) == (0, "processor", "TopK")


def test_replay_finds_a_changed_model(tmp_path) -> None:
    save_variant("llama-gqa", tmp_path / "a", seed=0)
    llm = nexttoken.load(tmp_path / "a")
    trace = llm.generate(PROMPT, max_new_tokens=5, trace=True).trace
    with torch.no_grad():
        llm.model.lm_head.weight[7] += 0.01  # one output row, a little
    report, _ = replay(trace, llm)
    assert (report.divergence.step, report.divergence.where) == (0, "model"), report.summary()


def test_compare_reports_a_shorter_run(tiny) -> None:
    llm, _ = tiny
    long = llm.generate(PROMPT, max_new_tokens=6, trace=True).trace
    short = llm.generate(PROMPT, max_new_tokens=4, trace=True).trace
    report = compare(long, short)
    assert report.divergence.where in ("stop", "length")


# ---- tracing off costs nothing: the operations of a step ----------------------------------------------------------

class OpLog(TorchDispatchMode):
    """Every aten operation dispatched while active, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def _plain_greedy_before(seq: Sequence) -> bool:
    """postprocess.plain_greedy as it was before traces existed."""
    s = seq.sampler
    alone = not len(seq.processors) or (
        len(seq.processors) == 1 and seq.grammar is not None and seq.params.logprobs_mode == "raw")
    return alone and seq.stopping is None and not seq.hooks and isinstance(s, Sampler) and s.greedy


def _advance_before(seq: Sequence, logits: torch.Tensor):  # noqa: ANN202
    """postprocess.advance as it was before traces existed."""
    ids = torch.tensor([seq.token_ids], device=logits.device) if len(seq.processors) else None  # (1, L)
    scores = seq.processors(ids, logits) if ids is not None else logits
    token = int(seq.sampler(scores)[0])
    logprob, top = seq.out.logprobs_of(logits[0], scores[0], token)
    stop = False
    if seq.stopping is not None:
        stop = bool(seq.stopping(torch.tensor([seq.token_ids + [token]], device=logits.device), scores)[0])
    delta = seq.out.push(token, logprob, top, stop)
    now = time.monotonic()
    seq.first_token_time = seq.first_token_time or now
    seq.last_token_time = now
    if seq.hooks:
        state = HookState(seq)
        done = torch.tensor([delta.finish_reason is not None])
        step = StepOutput(torch.tensor([token]), logits, scores, done, ~done, None)
        for hook in seq.hooks:
            hook.after_step(state, step)
    return snapshot(seq, delta, now)


def _ops_per_step(llm, opts: dict) -> list[list[str]]:  # noqa: ANN001
    engine = llm._driver_for([PROMPT], llm._request(dict(opts)).cfg).engine
    engine.add_request(PROMPT, llm._request(dict(opts)).cfg)
    steps = []
    while engine.has_unfinished():
        with OpLog() as log:
            engine.step()
        steps.append(log.ops)
    return steps


@pytest.mark.parametrize("opts", [dict(do_sample=False), dict(do_sample=True, top_k=5, temperature=0.8, seed=1,
                                                              repetition_penalty=1.1, top_logprobs=2)],
                         ids=["greedy", "sampled"])
def test_an_untraced_step_runs_the_operations_it_ran_before_traces(tiny, monkeypatch, opts) -> None:
    llm, _ = tiny
    opts = {**opts, "max_new_tokens": 5}
    _ops_per_step(llm, opts)  # the engine's first use allocates and plans: measure the steady state
    present = _ops_per_step(llm, opts)
    with monkeypatch.context() as m:  # the feature taken out: the step's choice as it was written before it
        m.setattr(llm_engine, "advance", _advance_before)
        m.setattr(llm_engine, "plain_greedy", _plain_greedy_before)
        m.setattr(postprocess, "plain_greedy", _plain_greedy_before)
        absent = _ops_per_step(llm, opts)
    assert len(present) == len(absent) == 5
    assert present == absent  # the same aten operations, in the same order, at every step
    traced = _ops_per_step(llm, {**opts, "trace": True})
    assert all(len(t) > len(p) for t, p in zip(traced, present))  # the count sees tracing when it is on


# ---- the command line ----------------------------------------------------------------------------------------------

def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    return subprocess.run([sys.executable, "-m", "nexttoken", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=300)


def test_cli_replay_of_a_library_trace(tiny, tmp_path) -> None:
    folder = str(tiny[0].path)  # a token-id-only model: the trace is written through the library
    ids_run = subprocess.run(
        [sys.executable, "-c", "import nexttoken, sys; from nexttoken.generation.trace.recorder import to_json; "
         f"llm = nexttoken.load({folder!r}); c = llm.generate({PROMPT}, max_new_tokens=6, do_sample=True, seed=4, "
         "trace=True, trace_top_n=4); open(sys.argv[1], 'w').write(to_json(c.trace))", str(tmp_path / "t.json")],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}, capture_output=True, text=True,
        timeout=300)
    assert ids_run.returncode == 0, ids_run.stderr
    same = _cli("replay", str(tmp_path / "t.json"), cwd=tmp_path)
    assert same.returncode == 0 and same.stdout.startswith("identical: 6 steps"), same.stdout + same.stderr
    changed = _cli("replay", str(tmp_path / "t.json"), "--option", "temperature=0.5", cwd=tmp_path)
    assert changed.returncode == 1 and "diverged at step 0 (chain: Temperature)" in changed.stdout, changed.stdout
    bad = _cli("replay", str(tmp_path / "missing.json"), cwd=tmp_path)
    assert bad.returncode == 2 and "cannot read the trace" in bad.stderr


def test_cli_generate_trace_writes_page_and_json(tmp_path) -> None:
    page = tmp_path / "out" / "explain.html"
    run = _cli("generate", "Once upon a time", "--trace", str(page), "--max-new-tokens", "5", "--trace-top-n", "3",
               cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    trace = json.loads(page.with_suffix(".json").read_text())
    html = page.read_text()
    assert len(trace["steps"]) == 5 and trace["top_n"] == 3
    assert run.stdout.strip() == "Once upon a time" + trace["text"]
    assert "<script src" not in html and "http://" not in html and "https://" not in html  # self-contained
    assert json.loads(html.split('id="trace-data">')[1].split("</script>")[0]) == trace
    again = _cli("replay", str(page.with_suffix(".json")), cwd=tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr


# ---- grammar masks, mirostat and a caller's criteria in the trace --------------------------------------------------

@pytest.fixture(scope="module")
def packaged():
    return nexttoken.load()


def test_a_grammar_mask_is_a_stage(packaged) -> None:
    c = packaged.generate("Once upon a time", max_new_tokens=8, choice=["yes", "no way"], trace=True)
    assert c.text in ("yes", "no way")
    for step in c.trace["steps"]:
        mask = [s for s in step["stages"] if s["name"] == "GrammarMask"]
        assert len(mask) == 1 and mask[0]["masked"] > 0
        assert step["chosen"]["id"] in mask[0]["top"]["ids"]  # the allowed tokens are what is left
        assert all(p > 0 for p in mask[0]["top"]["probs"])  # masked ones never listed as candidates
    report, _ = replay(c.trace, packaged)
    assert report.identical, report.summary()


def test_mirostat_draws_replay(packaged) -> None:
    c = packaged.generate("Once upon a time", max_new_tokens=10, do_sample=True, mirostat_tau=3.0, seed=9, trace=True)
    assert {s["sampler"]["kind"] for s in c.trace["steps"]} == {"MirostatV2"}
    assert len({s["sampler"]["state"] for s in c.trace["steps"]}) == 10  # the generator moves every draw
    report, _ = replay(c.trace, packaged)
    assert report.identical, report.summary()


def test_a_callers_criterion_is_recorded(packaged) -> None:
    def after_four(ids, scores):  # noqa: ANN001, ANN202
        return ids.shape[1] >= len(packaged.encode("Once upon a time")) + 4

    c = packaged.generate("Once upon a time", max_new_tokens=10, stopping_criteria=[after_four], trace=True)
    decisions = [{d["name"]: d["stop"] for d in s["stop"]}["criterion:after_four"] for s in c.trace["steps"]]
    assert decisions == [False, False, False, True] and len(c.token_ids) == 4


def test_each_sequence_has_its_own_trace_and_user_processors_are_stages(packaged) -> None:
    cs = packaged.generate("Once upon a time", max_new_tokens=4, do_sample=True, num_return_sequences=2, trace=True)
    seeds = [c.trace["steps"][0]["sampler"]["seed"] for c in cs]
    assert seeds[0] != seeds[1] and all(c.trace["output_ids"] == c.token_ids for c in cs)

    class Ban:
        def __call__(self, ids, scores):  # noqa: ANN001, ANN204
            return scores.index_fill(1, torch.tensor([cs[0].token_ids[0]]), -math.inf)

    c = packaged.generate("Once upon a time", max_new_tokens=3, do_sample=False, logits_processor=[Ban()],
                          guidance_scale=1.5, trace=True)
    stages = c.trace["steps"][0]["stages"]
    assert [s["name"] for s in stages] == ["ClassifierFreeGuidance", "Ban"]
    assert stages[1]["masked"] == 1 and stages[1]["changed"] == 1 and c.token_ids[0] != cs[0].token_ids[0]


def test_a_note_joins_its_step() -> None:
    from nexttoken.generation.processors.chain import Temperature
    from nexttoken.generation.trace.recorder import TraceRecorder

    rec = TraceRecorder(3, {"prompt_ids": [1]})
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    scores, token = rec.choose([Temperature(0.5)], Sampler(True), torch.tensor([[1]]), logits)
    rec.note("speculative", {"drafted": 4, "accepted": 2})
    assert token == 0 and torch.equal(scores, logits / 0.5)
    step = rec.to_dict()["steps"][0]
    assert step["notes"] == {"speculative": {"drafted": 4, "accepted": 2}}
    assert step["raw"]["ids"] == [0, 1, 2] and step["stages"][0]["top"]["probs"][0] == pytest.approx(
        float(torch.softmax(logits[0].double() / 0.5, -1)[0]))


def test_speculative_decisions_are_in_the_trace(tiny) -> None:
    """A draft equal to the target: every draft is kept (greedy: the same argmax; sampling: p/q = 1), each position
    of each verification is a traced step carrying its decision, and tracing changes no token (greedy: those of
    plain decoding; sampling draws by the rejection rule, so: those of the untraced speculative run)."""
    llm, _ = tiny
    for opts in ({}, {"do_sample": True, "seed": 3, "top_k": 20}):
        spec = dict(assistant_model=llm, num_assistant_tokens=3)
        plain = llm.generate(PROMPT, max_new_tokens=12, **opts, **(spec if opts else {}))
        c = llm.generate(PROMPT, max_new_tokens=12, trace=True, **opts, **spec)
        assert c.token_ids == plain.token_ids and c.trace["output_ids"] == plain.token_ids
        steps = c.trace["steps"]
        assert "notes" not in steps[0]  # the prompt's forward chose the first token
        notes = [s["notes"]["speculative"] for s in steps[1:]]
        assert len(notes) == 11 and notes[0]["position"] == 0
        for step, before, note in zip(steps[2:], notes, notes[1:]):
            # positions count up within a verification; one starts after the last kept draft (or the target's own)
            assert note["position"] == (before["position"] + 1 if before["kept"] else 0)
        for step, note in zip(steps[1:], notes):
            assert note["source"] == "draft model" and note["drafts"] <= 3
            assert note["kept"] == (note["draft"] is not None)  # the same model drafts what it then chooses
            if note["draft"] is not None:
                assert step["chosen"]["id"] == note["draft"]
                kind = "speculative rejection rule" if opts else "Sampler"
                assert step["sampler"]["kind"] == kind
