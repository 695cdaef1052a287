"""The paged KV pool: memory for the tokens that exist, prefix blocks shared by reference, preemption by recompute
and priority, with every request's greedy and seeded output the same bits as when it runs alone in a roomy pool."""

from __future__ import annotations

import resource

import pytest

import nexttoken
from nexttoken.engine import EngineConfig, LLMEngine
from nexttoken.engine.block_manager import DEFAULT_MEMORY_FRACTION
from nexttoken.errors import GenerationConfigError, PromptTooLongError
from nexttoken.generation.config import GenerationConfig
from nexttoken.model import fused
from nexttoken.model.memory import available_memory

GREEDY = GenerationConfig(eos_token_id=2, top_k=None)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def stories(shared_dir):
    return nexttoken.load(shared_dir / "models" / "stories260k")


def _engine(llm, **config) -> LLMEngine:
    return LLMEngine(llm.model, llm.tokenizer, EngineConfig(**{"chunk_size": 16, "max_num_seqs": 8, **config}))


def _prompts(llm, n: int) -> list[list[int]]:
    words = "the cat dog girl boy sun ball tree ran saw big red happy park".split()
    return [llm.encode(" ".join(words[i % 14 :] + words[: i % 5]) * (1 + i % 3)) for i in range(n)]


def _outputs(seqs) -> list[tuple[list[int], list[float]]]:
    return [(s.output_ids, s.out.logprobs) for s in seqs]


def _run(engine: LLMEngine, prompts: list[list[int]], params: GenerationConfig, **request) -> list:
    """The prompts as separate requests with the same options (a seed then draws the same way in each)."""
    seqs = [engine.add_request(p, params, **request) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    return seqs


def _alone(llm, prompts, params) -> list[tuple[list[int], list[float]]]:
    engine = _engine(llm)  # room for everything: no preemption
    return [_outputs(_run(engine, [p], params))[0] for p in prompts]


@pytest.mark.parametrize("path", ["native", "modules"])
def test_preempted_requests_give_the_same_bits_as_alone(stories, path) -> None:
    """A pool of 12 blocks (192 tokens) for 6 requests of ~100 tokens each: sequences are preempted and
    recomputed, every request completes, and each one's greedy ids and log-probs are exactly those it gets alone."""
    prompts = _prompts(stories, 6)
    params = GREEDY.updated(max_new_tokens=60, ignore_eos=True)
    seeded = params.updated(do_sample=True, seed=7, top_k=20)
    runs = []
    for p in (params, seeded):
        with fused.disabled() if path == "modules" else _nothing():
            engine = _engine(stories, num_kv_blocks=12)
            together = _outputs(_run(engine, prompts, p))
            runs.append((together, _alone(stories, prompts, p), engine.stats()))
    for together, alone, stats in runs:
        assert stats.preemptions_total > 0
        assert together == alone
        assert stats.kv_blocks_free == stats.kv_blocks_total  # every block came back


class _nothing:
    def __enter__(self):  # noqa: ANN204
        return self

    def __exit__(self, *exc) -> None:  # noqa: ANN002
        return None


def test_running_batch_is_limited_by_blocks_not_slots(stories) -> None:
    """max_num_seqs 16 but blocks for ~4 requests at a time: never more blocks in use than the pool has, and the
    waiting ones run as blocks come back."""
    engine = _engine(stories, max_num_seqs=16, num_kv_blocks=20)
    params = GREEDY.updated(max_new_tokens=40, ignore_eos=True)
    for p in _prompts(stories, 10):
        engine.add_request(p, params)
    while engine.has_unfinished():
        engine.step()
        stats = engine.stats()
        assert 0 <= stats.kv_blocks_free <= stats.kv_blocks_total == 20
        assert sum(len(s.block_table) for s in engine.scheduler.running) <= 20
    assert engine.stats().generated_tokens_total == 400


def test_prefix_blocks_are_shared_by_reference(stories) -> None:
    """Requests with one 64-token system prompt: its blocks are computed once and held once (the same block
    numbers in every table), and the outputs equal those without a prefix cache."""
    system = (stories.encode("Once upon a time there was a little girl named Lily. She liked to play") * 4)[:64]
    prompts = [system + stories.encode(f" {w} ran to the park") for w in ("Tom", "Sue", "Ben", "Max")]
    params = GREEDY.updated(max_new_tokens=8, ignore_eos=True)
    engine = _engine(stories, max_num_seqs=4)
    seqs = [engine.add_request(p, params) for p in prompts]
    tables = []
    while engine.has_unfinished():
        engine.step()
        tables += [list(s.block_table[:4]) for s in seqs if len(s.block_table) >= 4 and s.output_ids]
    shared = {tuple(t) for t in tables}
    assert len(shared) == 1, "the system prompt's 4 blocks are the same blocks for every request"
    stats = engine.stats()
    assert stats.prefix_hit_tokens == 3 * 64  # the first computes it, the other three find it
    assert [s.prefix_hit_tokens for s in seqs] == [0, 64, 64, 64]
    cold = _run(_engine(stories, max_num_seqs=4, enable_prefix_caching=False), prompts, params)
    assert _outputs(seqs) == _outputs(cold)


def test_cached_blocks_are_evicted_least_recently_used_first(stories) -> None:
    engine = _engine(stories, max_num_seqs=1, num_kv_blocks=9)  # 144 tokens: two 64-token prefixes fit, not three
    params = GREEDY.updated(max_new_tokens=4, ignore_eos=True)
    a, b, c = (stories.encode(f"{w} " * 40)[:64] for w in ("sun", "dog", "tree"))
    engine.generate([a + [400]], params)
    engine.generate([b + [400]], params)
    engine.generate([a + [401]], params)  # a is now the most recently used
    engine.generate([c + [400]], params)  # evicts b's blocks, not a's
    hits = engine.stats().prefix_hit_tokens
    assert engine.generate([a + [402]], params)[0].prefix_hit_tokens == 64
    assert engine.generate([b + [402]], params)[0].prefix_hit_tokens == 0
    assert engine.stats().prefix_hit_tokens == hits + 64


def test_priority_runs_first_and_preempts_less_important(stories) -> None:
    engine = _engine(stories, max_num_seqs=2, scheduling_policy="priority")
    params = GREEDY.updated(max_new_tokens=30, ignore_eos=True)
    prompts = _prompts(stories, 4)
    low = [engine.add_request(p, params, priority=5) for p in prompts[:2]]
    for _ in range(3):
        engine.step()
    urgent = engine.add_request(prompts[2], params.updated(max_new_tokens=5), priority=-1)
    steps = 0
    while not urgent.is_finished:
        engine.step()
        steps += 1
    # Admitted at once (a place taken from a low-priority one): a chunk a step, then 4 decode steps, never delayed.
    assert steps == -(-len(prompts[2]) // 16) + 4 and not any(s.is_finished for s in low)
    assert engine.stats().preemptions_total == 1
    while engine.has_unfinished():
        engine.step()
    assert _outputs(low + [urgent]) == _alone(stories, prompts[:3], params)[:2] + _alone(
        stories, prompts[2:3], params.updated(max_new_tokens=5))


def test_fcfs_ignores_priority(stories) -> None:
    engine = _engine(stories, max_num_seqs=1)
    params = GREEDY.updated(max_new_tokens=3)
    first = engine.add_request([1, 5, 6], params, priority=9)
    second = engine.add_request([1, 7, 8], params, priority=0)
    engine.step()
    assert first.status.value == "running" and second.status.value == "waiting"


def test_prompt_longer_than_the_pool_is_refused(stories) -> None:
    engine = _engine(stories, num_kv_blocks=4)  # 64 tokens
    with pytest.raises(PromptTooLongError, match="KV pool holds 64 .*--kv-cache-memory"):
        engine.add_request(list(range(3, 80)), GREEDY)
    seq = engine.generate([[1, 5, 9]], GREEDY.updated(max_new_tokens=500, ignore_eos=True))[0]
    assert len(seq.output_ids) == 64 - 3  # the length budget is what one request can hold
    whole = _engine(stories, chunk_size=64, num_kv_blocks=4)  # a first chunk as large as the pool still starts
    assert len(whole.generate([list(range(3, 63))], GREEDY.updated(max_new_tokens=9))[0].output_ids) == 4


def test_bad_pool_options_raise(stories) -> None:
    with pytest.raises(GenerationConfigError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp4")
    with pytest.raises(GenerationConfigError, match="scheduling_policy"):
        EngineConfig(scheduling_policy="lifo")
    with pytest.raises(GenerationConfigError, match="block_size 16 must divide chunk_size 8"):
        EngineConfig(chunk_size=8, block_size=16)
    with pytest.raises(GenerationConfigError, match="priority must be an integer"):
        _engine(stories).add_request([1, 5], GREEDY, priority="high")


def test_a_pool_that_cannot_be_had_fails_before_allocating(stories) -> None:
    too_much = available_memory("cpu") * 2
    with pytest.raises(GenerationConfigError, match=r"needs \d+ bytes .* lower --kv-cache-memory or --num-kv-blocks"):
        _engine(stories, kv_cache_memory=too_much)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def test_smollm2_default_flags_start_in_bounded_memory(smollm2_dir) -> None:
    """SmolLM2 (8K context) with --max-num-seqs 64: the slot design reserved 64 x 8192 tokens (24 GiB). The pool
    is a fraction of the memory available, and memory is committed only for the tokens written."""
    llm = nexttoken.load(smollm2_dir)
    before = _rss_bytes()
    available = available_memory("cpu")
    engine = LLMEngine(llm.model, llm.tokenizer, EngineConfig(max_num_seqs=64))
    stats = engine.stats()
    assert stats.kv_cache_bytes <= DEFAULT_MEMORY_FRACTION * available + 2 * 46080 * 16
    assert _rss_bytes() - before < 64 * 2**20  # nothing written yet: nothing committed
    seq = engine.generate([llm.encode("Hello")], GREEDY.updated(max_new_tokens=4, eos_token_id=None))[0]
    assert len(seq.output_ids) == 4
    assert _rss_bytes() - before < 256 * 2**20


@pytest.mark.parametrize("dtype", ["bf16", "int8"])
def test_compact_kv_dtypes_keep_batch_invariance_and_shrink_the_pool(stories, dtype) -> None:
    """bf16 halves and int8 (with a float32 scale per token and head) nearly quarters a block; preempted and
    batched requests still give each request's bits alone; the first tokens agree with the float32 pool."""
    prompts = _prompts(stories, 4)
    params = GREEDY.updated(max_new_tokens=30, ignore_eos=True)
    compact = _engine(stories, num_kv_blocks=10, kv_cache_dtype=dtype)
    together = _outputs(_run(compact, prompts, params))
    assert compact.stats().preemptions_total > 0
    alone = [_outputs(_run(_engine(stories, kv_cache_dtype=dtype), [p], params))[0] for p in prompts]
    assert together == alone
    full = _engine(stories, num_kv_blocks=10)
    ratio = compact.stats().kv_cache_bytes / full.stats().kv_cache_bytes
    assert ratio == (0.5 if dtype == "bf16" else (8 + 4) / 32)  # head_dim 8: one scale per 8 int8 values
    reference = _alone(stories, prompts, params)
    assert all(a[0][:10] == b[0][:10] for a, b in zip(together, reference))


def test_cli_names_agree_with_the_engine() -> None:
    from nexttoken.engine import llm_engine, scheduler
    from nexttoken.server import cli

    assert set(cli.KV_CACHE_DTYPES) == set(llm_engine.KV_CACHE_DTYPES)
    assert cli.POLICIES == scheduler.POLICIES
    assert cli.DEFAULT_MEMORY_PERCENT == round(DEFAULT_MEMORY_FRACTION * 100)
    assert cli._bytes("2GiB") == 2 * 2**30 and cli._bytes("512M") == 512 * 10**6 and cli._bytes("1000") == 1000


def test_native_step_reads_the_int8_pool_as_the_modules_do(stories, monkeypatch) -> None:
    """The fused native step quantizes new K/V and reads int8 blocks with their scales itself: the same tokens as the
    modules over the same pool (log-probs within float32 rounding), with preemptions on the way."""
    calls: list[int] = []
    real = fused.decode_rows
    monkeypatch.setattr(fused, "decode_rows", lambda *a: calls.append(1) or real(*a))
    prompts = _prompts(stories, 4)
    params = GREEDY.updated(max_new_tokens=30, ignore_eos=True)
    native = _run(_engine(stories, kv_cache_dtype="int8", num_kv_blocks=10), prompts, params)
    assert calls
    with fused.disabled():
        modules = _run(_engine(stories, kv_cache_dtype="int8"), prompts, params)
    for a, b in zip(native, modules):
        assert a.output_ids == b.output_ids
        assert a.out.logprobs == pytest.approx(b.out.logprobs, abs=1e-4)


def test_server_refuses_a_pool_it_cannot_have_and_a_prompt_past_its_pool(shared_dir) -> None:
    """Start-up with more KV memory than the machine has: exit 2 with the bytes and the flags, no traceback. A
    server with a 64-token pool answers a longer prompt with OpenAI's 400, names the pool, and keeps serving."""
    import subprocess
    import sys

    import httpx
    from support.server import start_server, stop_server

    model = shared_dir / "models" / "stories260k"
    done = subprocess.run([sys.executable, "-m", "nexttoken.cli", "serve", "--model", str(model), "--port", "1",
                           "--kv-cache-memory", "1000TiB"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "needs" in done.stderr and "--kv-cache-memory" in done.stderr and "Traceback" not in done.stderr
    proc, url = start_server(model, "--num-kv-blocks", "4")
    try:
        long = httpx.post(url + "/v1/completions", json={"prompt": "the cat " * 60, "max_tokens": 4}, timeout=60)
        assert long.status_code == 400 and "KV pool holds 64 tokens" in long.json()["error"]["message"]
        ok = httpx.post(url + "/v1/completions", json={"prompt": "the cat", "max_tokens": 4, "priority": 3},
                        timeout=60)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    finally:
        stop_server(proc)
