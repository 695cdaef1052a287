"""Speculative decoding: prompt lookup and a draft model in the engine are lossless (greedy tokens and log-probs equal
decoding without speculation, bit for bit, at any batch), and sampling keeps the target's distribution."""

from __future__ import annotations

import re

import pytest
import torch

import nexttoken
from nexttoken.engine import EngineConfig, LLMEngine
from nexttoken.errors import GenerationConfigError
from nexttoken.generation.config import GenerationConfig
from nexttoken.generation.speculative import DraftLength, accept_or_resample, prompt_lookup
from nexttoken.model import load_model

from support.tiny_models import RECURRENT, VARIANTS, save_variant


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def stories(shared_dir):
    return nexttoken.load(shared_dir / "models" / "stories260k")


@pytest.fixture(scope="module")
def helper(shared_dir):
    """A draft made from the target: every weight plus Gaussian noise of 0.1 times its own spread."""
    llm = nexttoken.load(shared_dir / "models" / "stories260k")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in llm.model.parameters():
            if p.numel() > 1:
                p.add_(torch.randn(p.shape, generator=g) * p.std() * 0.1)
    return llm


# Input-grounded prompts (the continuation tends to repeat them) and plain ones, so drafts are kept and rejected.
STORY_PROMPTS = [
    "Once upon a time, there was a little girl named Lily. She liked to play. Once upon a time, there was",
    "Tom had a big red ball",
    "The sun was hot. The sun was",
    "Lily and Tom went to the park. Lily and Tom",
    "One day, a cat",
    "Sue saw a bird. The bird was blue. Sue saw a",
    "Max",
    "The dog ran and ran. The dog",
]


def _outputs(completions):
    return [(c.token_ids, c.logprobs, c.top_logprobs, c.text, c.finish_reason) for c in completions]


def test_prompt_lookup_proposes_what_transformers_proposes() -> None:
    """Against transformers' PromptLookupCandidateGenerator on random sequences over a small vocabulary."""
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        ids = torch.randint(0, 6, (1, int(torch.randint(2, 30, (1,), generator=g))), generator=g)
        k, n = 1 + trial % 5, 1 + trial % 3
        ref = PromptLookupCandidateGenerator(num_output_tokens=k, max_matching_ngram_size=n, max_length=1000)
        candidates, _ = ref.get_candidates(ids)
        assert prompt_lookup(ids[0].tolist(), k, n) == candidates[0, ids.shape[1]:].tolist()
    assert prompt_lookup([5, 6, 7, 8, 5, 6], 3, 2) == [7, 8, 5]  # worked by hand: "5 6" first at 0
    assert prompt_lookup([1, 2, 3], 3, 2) == []


def test_draft_length_schedules() -> None:
    length = DraftLength(5, "heuristic")
    length.update(5, 5)
    assert length.num_tokens == 7
    length.update(7, 2)
    assert length.num_tokens == 6
    constant = DraftLength(5)
    constant.update(5, 0)
    assert constant.num_tokens == 5


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("source", ["prompt_lookup", "draft_model"])
def test_greedy_identical_to_plain_greedy_on_stories260k(stories, helper, batch, source) -> None:
    """Tokens, log-probs, top log-probs, text and finish reasons equal decoding without speculation."""
    prompts = STORY_PROMPTS[:batch]
    base = dict(max_new_tokens=48, top_logprobs=3, stop_strings=["Lily"] if batch > 1 else None)
    plain = stories.generate(prompts, **base)
    if source == "prompt_lookup":
        spec = stories.generate(prompts, prompt_lookup_num_tokens=4, **base)
    else:
        spec = stories.generate(prompts, assistant_model=helper, num_assistant_tokens=4, **base)
    assert _outputs(spec) == _outputs(plain)
    stats = stories._driver.engine.stats()
    assert stats.spec_steps_total > 0 and 0 < stats.spec_accepted_tokens_total < stats.spec_draft_tokens_total


def test_streaming_with_speculation_gives_the_same_text(stories) -> None:
    prompt = STORY_PROMPTS[0]
    plain = stories.generate(prompt, max_new_tokens=40).text
    assert "".join(stories.stream(prompt, max_new_tokens=40, prompt_lookup_num_tokens=5)) == plain


def test_eos_and_max_new_tokens_end_speculative_requests_where_plain_ones_end(stories) -> None:
    """max_new_tokens 1..6 cut inside a verified run of drafts; EOS (a token the drafts repeat) stops at it."""
    prompt = STORY_PROMPTS[2]
    for n in range(1, 7):
        plain = stories.generate(prompt, max_new_tokens=n)
        spec = stories.generate(prompt, max_new_tokens=n, prompt_lookup_num_tokens=8)
        assert _outputs([spec]) == _outputs([plain]) and len(spec.token_ids) == n
    plain = stories.generate(prompt, max_new_tokens=40)
    eos = plain.token_ids[5]
    stopped = stories.generate(prompt, max_new_tokens=40, eos_token_id=eos, prompt_lookup_num_tokens=8)
    expected = stories.generate(prompt, max_new_tokens=40, eos_token_id=eos)
    assert _outputs([stopped]) == _outputs([expected]) and stopped.finish_reason == "stop"


def test_processors_apply_to_draft_and_target_alike_and_stay_lossless(stories, helper) -> None:
    """Greedy under processors that read the generated ids (repetition penalty, no-repeat n-grams, min length):
    each position is chosen with the ids accepted before it, so the output is the plain one."""
    options = dict(max_new_tokens=40, top_logprobs=1, repetition_penalty=1.3, no_repeat_ngram_size=3,
                   min_new_tokens=5, logprobs_mode="processed")
    plain = stories.generate(STORY_PROMPTS[:4], **options)
    assert _outputs(stories.generate(STORY_PROMPTS[:4], prompt_lookup_num_tokens=4, **options)) == _outputs(plain)
    with_draft = stories.generate(STORY_PROMPTS[:4], assistant_model=helper, num_assistant_tokens=3,
                                  num_assistant_tokens_schedule="heuristic", **options)
    assert _outputs(with_draft) == _outputs(plain)


def test_bfloat16_modules_path_is_lossless(tmp_path) -> None:
    """A bfloat16 model runs the modules path (bucketed, padded groups): verification rows still give the plain
    engine's numbers."""
    save_variant("llama-gqa", tmp_path)
    target = load_model(tmp_path, dtype="bfloat16")
    prompts = [[1, 5, 9, 22] * 3, [1, 7, 8], [1, 50, 51, 52, 50, 51]]
    cfg = GenerationConfig(max_new_tokens=20, top_k=None, top_logprobs=2, eos_token_id=2)

    def run(**options):
        engine = LLMEngine(target, None, EngineConfig(chunk_size=8, max_num_seqs=4, max_model_len=128))
        seqs = [engine.add_request(p, cfg.updated(**options), draft_model=target if options else None) for p in prompts]
        while engine.has_unfinished():
            engine.step()
        return [(s.out.token_ids, s.out.logprobs, s.out.top_logprobs) for s in seqs], engine.stats()

    plain, _ = run()
    drafted, stats = run(num_assistant_tokens=4)
    assert drafted == plain and stats.spec_accepted_tokens_total > 0


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v not in RECURRENT])  # refused: test_hybrid_engine
def test_greedy_identical_on_every_architecture(tmp_path, variant) -> None:
    """Random tiny models of each architecture (native step or modules path): prompt lookup and a draft model
    (the same architecture with other weights) give the plain engine's tokens and log-probs, batched."""
    save_variant(variant, tmp_path / "target")
    save_variant(variant, tmp_path / "draft", seed=1)
    target, draft = load_model(tmp_path / "target"), load_model(tmp_path / "draft")
    g = torch.Generator().manual_seed(1)
    prompts = [[1] + torch.randint(3, 96, (int(n),), generator=g).tolist() for n in (3, 9, 20, 5)]
    prompts[1] = prompts[1] * 3  # a repeated prompt: prompt lookup finds matches
    cfg = GenerationConfig(max_new_tokens=24, top_k=None, top_logprobs=2, eos_token_id=2)

    def run(draft_model=None, **options):
        engine = LLMEngine(target, None, EngineConfig(chunk_size=8, max_num_seqs=4, max_model_len=128))
        seqs = [engine.add_request(p, cfg.updated(**options), draft_model=draft_model) for p in prompts]
        while engine.has_unfinished():
            engine.step()
        return [(s.out.token_ids, s.out.logprobs, s.out.top_logprobs) for s in seqs], engine.stats()

    plain, _ = run()
    lookup, stats = run(prompt_lookup_num_tokens=3)
    assert lookup == plain and stats.spec_steps_total > 0
    drafted, stats = run(draft, num_assistant_tokens=3)
    assert drafted == plain and stats.spec_draft_tokens_total > 0
    # The target as its own draft: (nearly) every draft kept. Not all: the draft decodes in its own slots and
    # groups, and a last-bit difference turns a near-tie of these random logits (gemma3: 41 of 46 kept).
    own, stats = run(target, num_assistant_tokens=3)
    assert own == plain and stats.spec_accepted_tokens_total >= 0.8 * stats.spec_draft_tokens_total > 0


def test_rejection_rule_keeps_the_target_distribution() -> None:
    """accept_or_resample's tokens are distributed as p, for a draft distribution q far from p, for one-hot
    drafts (prompt lookup's), and for q = p; chi-square against p over 8 tokens."""
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.30, 0.20, 0.15, 0.12, 0.10, 0.08, 0.05, 0.0], dtype=torch.float64)
    biased = torch.tensor([0.01, 0.01, 0.01, 0.01, 0.01, 0.05, 0.40, 0.50], dtype=torch.float64)  # 7: p = 0
    n = 20000
    for q in (biased, None, p):
        counts = torch.zeros(8)
        kept = 0
        for _ in range(n):
            if q is None:
                draft = 6
            else:
                draft = int(torch.multinomial(q, 1, generator=g))
            token, ok = accept_or_resample(p, q, draft, g)
            counts[token] += 1
            kept += ok
        expected = p[:7] * n
        chi2 = float(((counts[:7] - expected) ** 2 / expected).sum())
        assert counts[7] == 0
        assert chi2 < 22.5, (q, counts, chi2)  # 6 degrees of freedom: p = 0.001
        if q is p:
            assert kept == n  # the draft's own distribution: every draft is kept


def test_sampled_speculation_matches_the_target_distribution(tmp_path) -> None:
    """End to end: the second sampled token's empirical distribution, while a draft model proposes it, equals the
    target's exact marginal sum_t1 p(t1) p(t2 | t1) computed by transformers on the same weights (chi-square).
    The draft is the target with perturbed weights: it agrees often and is wrong in a systematic way, and with
    top_k=4 (applied to draft and target alike) a rule that resampled from p instead of the residual would
    show. (Deterministic, prompt-lookup drafts: test_rejection_rule_keeps_the_target_distribution.)"""
    hf = save_variant("llama-gqa", tmp_path / "t")
    target, draft = load_model(tmp_path / "t"), load_model(tmp_path / "t")
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for w in draft.parameters():
            if w.numel() > 1:
                w.add_(torch.randn(w.shape, generator=g) * w.std() * 0.5)
    prompt = [1, 5, 17, 33]
    temperature, top_k = 1.5, 4

    def processed(logits: torch.Tensor) -> torch.Tensor:  # (..., V) -> the distribution sampled from
        scaled = logits.float() / temperature
        kth = scaled.topk(top_k, dim=-1).values[..., -1:]
        return scaled.masked_fill(scaled < kth, -torch.inf).softmax(-1)

    with torch.no_grad():  # the reference: transformers on the same weights
        p1 = processed(hf(torch.tensor([prompt])).logits[0, -1])  # (V,)
        seconds = torch.tensor([prompt + [t] for t in range(p1.shape[0])])
        p2 = processed(hf(seconds).logits[:, -1])  # (V, V): row t1 -> p(t2 | t1)
    marginal = (p1[:, None] * p2).sum(0).double()  # (V,)
    n = 1200
    engine = LLMEngine(target, None, EngineConfig(chunk_size=8, max_num_seqs=64, max_model_len=128))
    # The first token comes from the prompt's pass; the second is the rejection rule's, against one draft.
    cfg = GenerationConfig(do_sample=True, temperature=temperature, top_k=top_k, max_new_tokens=3,
                           num_assistant_tokens=1)
    seqs = [engine.add_request(prompt, cfg.updated(seed=i), draft_model=draft) for i in range(n)]
    while engine.has_unfinished():
        engine.step()
    stats = engine.stats()
    assert stats.spec_draft_tokens_total == n and 0 < stats.spec_accepted_tokens_total < n
    counts = torch.bincount(torch.tensor([s.out.token_ids[1] for s in seqs]), minlength=p1.shape[0]).double()
    assert counts[marginal == 0].sum() == 0  # nothing outside every row's top-k
    expected = marginal * n
    big, rare = expected >= 5, (expected < 5) & (marginal > 0)  # the rare tokens pooled into one bin
    obs = torch.cat([counts[big], counts[rare].sum()[None]] if rare.any() else [counts[big]])
    exp = torch.cat([expected[big], expected[rare].sum()[None]] if rare.any() else [expected[big]])
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    dof = len(obs) - 1
    assert chi2 < dof + 4 * (2 * dof) ** 0.5, ("chi2", chi2, dof)  # ~ p = 0.001 for these degrees of freedom


def test_seeded_speculative_sampling_is_reproducible(stories) -> None:
    options = dict(do_sample=True, seed=7, max_new_tokens=30, prompt_lookup_num_tokens=4)
    assert stories.generate(STORY_PROMPTS[0], **options).token_ids == stories.generate(STORY_PROMPTS[0], **options).token_ids


def test_bad_speculation_options_raise(stories, tmp_path) -> None:
    with pytest.raises(GenerationConfigError, match="num_assistant_tokens"):
        stories.generate("Hi", num_assistant_tokens=0)
    with pytest.raises(GenerationConfigError, match="num_assistant_tokens_schedule"):
        stories.generate("Hi", num_assistant_tokens_schedule="sometimes")
    with pytest.raises(GenerationConfigError, match="use one"):
        stories.generate("Hi", assistant_model=stories, prompt_lookup_num_tokens=3)
    with pytest.raises(GenerationConfigError, match="prompt_lookup_num_tokens too"):
        stories.generate("Hi", max_matching_ngram_size=3)
    with pytest.raises(GenerationConfigError, match="not beam"):
        stories.generate("Hi", num_beams=2, prompt_lookup_num_tokens=3)
    with pytest.raises(GenerationConfigError, match="LLM or model"):
        stories.generate("Hi", assistant_model="a path")
    other = nexttoken.load()  # the packaged model: another tokenizer
    with pytest.raises(GenerationConfigError, match="different tokenizer"):
        stories.generate("Hi", assistant_model=other)
    save_variant("llama-gqa", tmp_path)
    with pytest.raises(GenerationConfigError, match="vocabulary"):
        stories.generate([1, 5], assistant_model=load_model(tmp_path))
    with pytest.raises(GenerationConfigError, match="runs in the engine"):
        nexttoken.generate(stories.model, torch.tensor([[1, 5]]), prompt_lookup_num_tokens=3)


def _serve_completions(model_dir, *extra: str):
    """Greedy completions of STORY_PROMPTS (one request, 8 choices, log-probs) from a real server, and its /metrics."""
    import httpx
    import openai

    from support.server import start_server, stop_server

    proc, url = start_server(model_dir, *extra)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        got = client.completions.create(model=model, prompt=STORY_PROMPTS, max_tokens=32, temperature=0, logprobs=2)
        chunks = list(client.completions.create(model=model, prompt=STORY_PROMPTS[0], max_tokens=32, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        metrics = httpx.get(url + "/metrics").text
    finally:
        stop_server(proc)
    choices = sorted(got.choices, key=lambda c: c.index)
    details = got.usage.completion_tokens_details
    metrics += f"\nusage_accepted {details.accepted_prediction_tokens if details else 0}"
    metrics += f"\nusage_rejected {details.rejected_prediction_tokens if details else 0}"
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == got.choices[[c.index for c in got.choices].index(0)].text  # streaming: the same text
    details = chunks[-1].usage.completion_tokens_details
    metrics += f"\nstream_accepted {details.accepted_prediction_tokens if details else 0}"
    metrics += f"\nstream_rejected {details.rejected_prediction_tokens if details else 0}"
    return [(c.text, c.logprobs.tokens, c.logprobs.token_logprobs, c.logprobs.top_logprobs) for c in choices], metrics


def _metric(metrics: str, name: str) -> float:
    return float(re.search(rf"^{name} (\S+)", metrics, re.M).group(1))


@pytest.fixture(scope="module")
def plain_server_output(shared_dir):
    pytest.importorskip("openai")
    return _serve_completions(shared_dir / "models" / "stories260k")[0]


@pytest.mark.parametrize("flag", ["--speculative-ngram", "--speculative-model"])
def test_server_speculation_gives_plain_greedy_output_and_reports_acceptance(shared_dir, plain_server_output,
                                                                             flag) -> None:
    """A real server with speculation for every request, driven by the openai client: a batch of 8 greedy
    completions with log-probs equals the same server's without speculation; /metrics counts the drafts."""
    model_dir = shared_dir / "models" / "stories260k"
    extra = [flag] + ([str(model_dir)] if flag == "--speculative-model" else []) + ["--num-speculative-tokens", "3"]
    got, metrics = _serve_completions(model_dir, *extra)
    assert got == plain_server_output
    # /metrics counts both requests (the 8 choices, then the stream); the usage of the first counts its own.
    accepted = _metric(metrics, "nexttoken_spec_decode_accepted_tokens_total")
    drafted = _metric(metrics, "nexttoken_spec_decode_draft_tokens_total")
    assert 0 < accepted <= drafted
    assert 0 < _metric(metrics, "nexttoken_spec_decode_acceptance_rate") <= 1
    # The response's usage: OpenAI's predicted-output fields count this request's kept and rejected drafts.
    assert _metric(metrics, "usage_accepted") + _metric(metrics, "stream_accepted") == accepted
    assert _metric(metrics, "usage_rejected") + _metric(metrics, "stream_rejected") == drafted - accepted
    assert _metric(metrics, "stream_accepted") + _metric(metrics, "stream_rejected") > 0
    if flag == "--speculative-model":  # the target as its own draft: (nearly) every draft kept
        assert accepted >= 0.9 * drafted


def test_bench_speculative_reports_speed_acceptance_and_same_output(tmp_path, capsys) -> None:
    """`nexttoken bench --speculative` on the micro shape: prompt lookup and drafts made from the target; every
    speculative variant's output was the plain output, and a draft that is the target unperturbed keeps all."""
    import json

    from nexttoken.cli import main

    out = tmp_path / "spec"
    assert main(["bench", "--speculative", "--shape", "micro", "--cache-dir", str(tmp_path / "cache"),
                 "--prompt-len", "16", "--new-tokens", "12", "--batch-sizes", "1,2", "--rounds", "1",
                 "--threads", "1", "--out", str(out)]) == 0
    assert main(["bench", "--speculative", "--shape", "micro", "--cache-dir", str(tmp_path / "cache"),
                 "--prompt-len", "16", "--new-tokens", "12", "--batch-sizes", "1", "--rounds", "1", "--threads", "1",
                 "--draft-noise", "0,1", "--out", str(out) + "-draft"]) == 0
    lookup = json.loads(out.with_suffix(".json").read_text())["rows"]
    drafts = json.loads((tmp_path / "spec-draft.json").read_text())["rows"]
    assert [r["variant"] for r in lookup] == ["plain", "prompt lookup, k=4"] * 2
    speculative = [r for r in lookup + drafts if r["variant"] != "plain"]
    assert all(r["identical"] and r["tok_s"] > 0 for r in speculative)
    assert drafts[1]["variant"] == "draft (noise 0.0), k=4" and drafts[1]["acceptance"] == 1.0
    assert "| prompt lookup, k=4 | 1 |" in capsys.readouterr().out


def test_tail_scale_target_is_its_first_blocks_at_zero_and_itself_at_one(tmp_path) -> None:
    """bench's TailScale: with the blocks after the first scaled by 0 the target greedily writes what transformers'
    Llama cut to that first block writes on the same weights; scale 1 restores the unscaled target exactly."""
    from transformers import AutoModelForCausalLM

    from nexttoken.bench.shapes import random_checkpoint
    from nexttoken.bench.speculative import TailScale

    path = random_checkpoint("micro", "float32", tmp_path / "micro")
    llm = nexttoken.load(path)
    prompt = [1] + torch.randint(3, 512, (10,), generator=torch.Generator().manual_seed(0)).tolist()
    greedy = dict(max_new_tokens=12, do_sample=False, ignore_eos=True)
    full = llm.generate([prompt], **greedy)[0].token_ids
    tail = TailScale(llm.model, 1)
    tail.set(0.0)
    cut = llm.generate([prompt], **greedy)[0].token_ids
    hf = AutoModelForCausalLM.from_pretrained(path, num_hidden_layers=1, torch_dtype=torch.float32)
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
    assert cut == expected[0, len(prompt):].tolist()
    tail.set(1.0)
    assert llm.generate([prompt], **greedy)[0].token_ids == full
    with pytest.raises(ValueError, match="--draft-layers"):
        TailScale(llm.model, 2)


def test_bench_tail_scale_sweeps_acceptance(tmp_path, capsys) -> None:
    """`bench --speculative --draft-layers 1 --target-tail-scale 0,100` on the micro shape: at 0 the draft (the
    target's first block) is kept every time, at 100 not; the output is the plain output throughout, also with
    an int8 draft; a sweep without --draft-layers is refused."""
    import json

    from nexttoken.cli import main

    base = ["bench", "--speculative", "--shape", "micro", "--cache-dir", str(tmp_path / "cache"), "--prompt-len", "16",
            "--new-tokens", "24", "--batch-sizes", "1", "--rounds", "1", "--threads", "1"]
    out = tmp_path / "tail"
    assert main([*base, "--draft-layers", "1", "--target-tail-scale", "0,100", "--out", str(out)]) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [r["variant"] for r in rows] == ["plain, tail x0", "draft (1 blocks), tail x0, k=4",
                                            "plain, tail x100", "draft (1 blocks), tail x100, k=4"]
    assert rows[1]["acceptance"] == 1.0 and rows[3]["acceptance"] < 0.95
    assert rows[1]["identical"] and rows[3]["identical"]
    assert main([*base, "--draft-layers", "1", "--target-tail-scale", "0", "--draft-quantize", "int8",
                 "--out", str(out) + "-int8"]) == 0
    rows = json.loads((tmp_path / "tail-int8.json").read_text())["rows"]
    assert rows[1]["variant"] == "draft (1 blocks, int8), tail x0, k=4" and rows[1]["identical"]
    assert main([*base, "--target-tail-scale", "0,1"]) != 0
    assert "--target-tail-scale needs factors (e.g. 0,0.3,1) and --draft-layers N" in capsys.readouterr().err


def test_completions_carry_token_counts_and_draft_counts_as_the_usage_does(shared_dir) -> None:
    """Completion.prompt_tokens / completion_tokens, and accepted / rejected draft tokens per completion, which
    add up to the engine's own totals (the numbers the server's usage and /metrics report)."""
    llm = nexttoken.load(shared_dir / "models" / "stories260k")  # its own engine: totals of this call alone
    spec = llm.generate(STORY_PROMPTS, max_new_tokens=32, prompt_lookup_num_tokens=4)
    stats = llm._driver.engine.stats()
    for prompt, c in zip(STORY_PROMPTS, spec):
        assert c.prompt_tokens == len(c.prompt_token_ids) == len(llm.encode(prompt))
        assert c.completion_tokens == len(c.token_ids) > 0
    assert sum(c.accepted_draft_tokens for c in spec) == stats.spec_accepted_tokens_total > 0
    assert sum(c.rejected_draft_tokens for c in spec) == stats.spec_draft_tokens_total - stats.spec_accepted_tokens_total > 0
    plain = llm.generate(STORY_PROMPTS[0], max_new_tokens=8, echo=True)
    assert (plain.prompt_tokens, plain.completion_tokens) == (len(llm.encode(STORY_PROMPTS[0])), 8)
    assert plain.accepted_draft_tokens == plain.rejected_draft_tokens == 0
