"""The fused native step on issue 41's recurrent layer kinds (csrc/recurrent.cpp): LFM2's gated short convolution,
Qwen3.5's gated delta rule (with its gated, partially rotated attention), Granite 4.0-H's and Mamba2's SSD, and the
hybrid families' own networks: Falcon-H1 (a Mamba2 mixer beside the attention in each layer, µP multipliers) and
Nemotron-H (Mamba2 / NoPE attention layers, squared-ReLU MLPs). Each row's state slot is read and updated in place
by the native code. Against the modules path (fused.disabled), the reference: 24 teacher-forced decode steps at
batch 1 and 3 (log-probs and the states left behind within float32 rounding, every step native), one step's logits
within 1e-5, greedy tokens equal to the modules' and transformers', and the engine's native rows of a mixed batch
equal to the modules', each row's numbers independent of its batch-mates; for the two networks also seeded samples
equal to the modules' and log-probs no further from a float64 run of the modules than the modules are."""

from __future__ import annotations

import pytest
import torch

from nexttoken.engine import EngineConfig, LLMEngine
from nexttoken.generation import generate
from nexttoken.generation.config import GenerationConfig
from nexttoken.model import ForwardBatch, fused, kernels, load_model
from support.fused import step_logits
from support.tiny_models import RECURRENT, VARIANTS, build_hf_model, save_variant

pytestmark = pytest.mark.skipif(not kernels.available(), reason="native kernel unavailable (no g++ or no AVX-512)")

PROMPTS = torch.tensor([[1, 5, 17, 33, 9, 60], [1, 40, 41, 42, 43, 44], [1, 90, 3, 3, 8, 12]])
ENGINE_PROMPTS = [[1, 5, 17, 33, 9, 60], [1, 40], [1, 90, 3, 3, 8, 12, 7, 7, 7, 70, 71], [1, 2, 3]]
STEPS = 24
# The hybrid families with networks of their own, which the native step computes (their float64 and seeded checks)
NATIVE_NETWORKS = {"falcon_h1", "nemotron_h"}


# Nemotron 3's experts (squared-ReLU, ungated): the native step has no such expert, so the modules run it
MODULES_HYBRIDS = frozenset({"nemotron_h-moe"})


@pytest.fixture(scope="module", params=sorted(RECURRENT - MODULES_HYBRIDS))
def variant(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = save_variant(request.param, folder)
    return request.param, hf, load_model(folder)


def _counting(monkeypatch, *names: str) -> list[bool]:
    """Whether each call of fused's `names` ran natively (True) or refused (False)."""
    calls: list[bool] = []
    for name in names:
        real = getattr(fused, name)

        def call(*args, _real=real):  # noqa: ANN002, ANN202
            out = _real(*args)
            calls.append(out is not None)
            return out

        monkeypatch.setattr(fused, name, call)
    return calls


@torch.inference_mode()
def _forced(model, ids: torch.Tensor, steps: int = STEPS) -> tuple[torch.Tensor, dict]:  # noqa: ANN001
    """(steps, B, V) log-probs of `steps` decode steps after a 6-token prefill, each fed the given next token, and
    the recurrent states left behind (layer -> its tensors)."""
    B, P = ids.shape[0], 6
    S = P + steps
    valid = torch.ones(B, S, dtype=torch.bool)
    cache = model.new_cache(B, S)
    cols = torch.arange(P).expand(B, P)
    model(ids[:, :P], ForwardBatch.build(cols, cols, valid, P, write_start=0), cache)
    out = []
    for t in range(P, S):
        pos = torch.full((B, 1), t)
        out.append(model(ids[:, t : t + 1], ForwardBatch.build(pos, pos, valid, t + 1, write_start=t),
                         cache).log_softmax(-1))
    return torch.stack(out), {layer: [t.clone() for t in ts] for layer, ts in cache.states.tensors.items()}


@pytest.mark.parametrize("rows", [1, 3])
def test_teacher_forced_steps_and_states_equal_the_modules(variant, rows, monkeypatch) -> None:
    """24 native steps (every one native): log-probs within float32 rounding of the modules', the same top-1 at
    every step, and every layer's state slots (convolution windows, delta-rule / SSD matrices) likewise."""
    name, _, model = variant
    ids = torch.randint(5, model.config.vocab_size, (rows, 6 + STEPS), generator=torch.Generator().manual_seed(3))
    calls = _counting(monkeypatch, "decode_step")
    native, native_states = _forced(model, ids)
    assert len(calls) == STEPS and all(calls)
    with fused.disabled():
        modules, modules_states = _forced(model, ids)
    assert torch.equal(native.argmax(-1), modules.argmax(-1))
    assert torch.allclose(native, modules, atol=1e-4, rtol=0), (native - modules).abs().max()
    assert native_states.keys() == modules_states.keys() and native_states
    for layer, tensors in native_states.items():
        for a, b in zip(tensors, modules_states[layer]):
            assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), (name, layer, (a - b).abs().max())


@pytest.mark.parametrize("rows", [1, 3])
def test_greedy_tokens_equal_the_modules_and_transformers(variant, rows, monkeypatch) -> None:
    """generate(): one row (after its first step, greedy chains of native steps) and three rows, 24 tokens equal
    to the modules'; the first 12 equal to transformers' (its torch fallbacks are slow)."""
    _, hf, model = variant
    kwargs = dict(max_new_tokens=STEPS, do_sample=False, eos_token_id=None)
    calls = _counting(monkeypatch, "decode_step", "greedy_chain")
    fast = generate(model, PROMPTS[:rows], **kwargs)
    assert calls and all(calls)
    with fused.disabled():
        assert torch.equal(fast, generate(model, PROMPTS[:rows], **kwargs))
    want = hf.generate(PROMPTS[:rows], pad_token_id=0, **{**kwargs, "max_new_tokens": 12})
    assert torch.equal(fast[:, : want.shape[1]], want)


def test_step_logits_within_float32_rounding_of_the_modules(variant, monkeypatch) -> None:
    """One native decode step of two rows after a 6-token prefill: the modules' logits within 1e-5."""
    _, _, model = variant
    with fused.disabled():
        reference = step_logits(model)
    calls = _counting(monkeypatch, "decode_step")
    got = step_logits(model)
    assert calls == [True]
    torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", sorted(NATIVE_NETWORKS), indirect=True)
def test_seeded_sampling_equals_the_modules(variant, monkeypatch) -> None:
    """Three rows sampled (temperature, top-k, one seed) for 24 tokens, every step native: the modules' tokens."""
    _, _, model = variant
    kwargs = dict(max_new_tokens=STEPS, do_sample=True, temperature=0.9, top_k=20, seed=11, eos_token_id=None)
    calls = _counting(monkeypatch, "decode_step")
    fast = generate(model, PROMPTS, **kwargs)
    assert len(calls) == STEPS - 1 and all(calls)
    with fused.disabled():
        assert torch.equal(fast, generate(model, PROMPTS, **kwargs))


@pytest.mark.parametrize("variant", sorted(NATIVE_NETWORKS), indirect=True)
def test_native_step_is_as_close_to_float64_as_the_modules(variant, tmp_path, monkeypatch) -> None:
    """16 teacher-forced steps of two rows, every one native: the log-probs no further from the modules' computed
    in float64 (the variant's weights loaded again, then widened) than the float32 modules are, with a margin for
    the different sum orders (as tests/model/test_fused_families.py holds the attention families)."""
    _, hf, _ = variant
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path)
    ids = torch.randint(5, model.config.vocab_size, (2, 22), generator=torch.Generator().manual_seed(5))
    calls = _counting(monkeypatch, "decode_step")
    native, _ = _forced(model, ids, 16)
    assert len(calls) == 16 and all(calls)
    with fused.disabled():
        modules, _ = _forced(model, ids, 16)
        exact, _ = _forced(model.double(), ids, 16)
    native_error, modules_error = (native - exact).abs().max().item(), (modules - exact).abs().max().item()
    assert native_error <= 3 * modules_error + 1e-6, (native_error, modules_error)


def test_falcon_h1_without_its_mamba_norm_gates_alone(tmp_path, monkeypatch) -> None:
    """Falcon-H1 with mamba_rms_norm false (its mixer's output only gated by silu(z), no norm weight): the native
    step runs and gives the modules' logits within 1e-5, and greedy tokens equal to transformers'."""
    arch, overrides = VARIANTS["falcon_h1"]
    hf = build_hf_model(arch, **{**overrides, "mamba_rms_norm": False})
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path)
    assert model.layers[0].mamba.norm is None
    with fused.disabled():
        reference = step_logits(model)
    calls = _counting(monkeypatch, "decode_step", "greedy_chain")
    torch.testing.assert_close(step_logits(model), reference, rtol=1e-5, atol=1e-5)
    kwargs = dict(max_new_tokens=8, do_sample=False, eos_token_id=None)
    fast = generate(model, PROMPTS[:2], **kwargs)
    assert calls and all(calls)
    assert torch.equal(fast, hf.generate(PROMPTS[:2], pad_token_id=0, **kwargs))


def _engine_run(model, prompts: list[list[int]], steps: int) -> list:  # noqa: ANN001
    engine = LLMEngine(model, None, EngineConfig(max_num_seqs=4, max_model_len=64, chunk_size=8))
    seqs = [engine.add_request(p, GenerationConfig(max_new_tokens=steps, eos_token_id=None, top_k=None))
            for p in prompts]
    while engine.has_unfinished():
        engine.step()
    return seqs


def test_engine_rows_take_the_native_step_and_equal_the_modules(variant, monkeypatch) -> None:
    """A mixed batch of four prompts of different lengths (prefilled in chunks of 8 while the others decode), 20
    tokens each: every decode row native, each row's state slot its own, the modules' tokens and log-probs.
    (tests/engine/test_hybrid_engine.py holds the engine's tokens, now native, to transformers' as well.)"""
    _, _, model = variant
    calls = _counting(monkeypatch, "decode_rows")
    native = _engine_run(model, ENGINE_PROMPTS, 20)
    assert calls and all(calls)
    with fused.disabled():
        modules = _engine_run(model, ENGINE_PROMPTS, 20)
    for a, b in zip(native, modules):
        assert a.output_ids == b.output_ids
        assert a.out.logprobs == pytest.approx(b.out.logprobs, abs=1e-4)


def test_engine_native_rows_do_not_depend_on_batch_mates(variant) -> None:
    """Each request alone and among three others of other lengths (other slots, other groupings): the same bits."""
    _, _, model = variant
    together = _engine_run(model, ENGINE_PROMPTS, 10)
    for prompt, seq in zip(ENGINE_PROMPTS, together):
        (alone,) = _engine_run(model, [prompt], 10)
        assert alone.output_ids == seq.output_ids and alone.out.logprobs == seq.out.logprobs


@pytest.mark.parametrize("name", sorted(MODULES_HYBRIDS))
def test_families_with_parts_it_lacks_run_the_modules(name, tmp_path) -> None:
    """Nemotron 3's squared-ReLU experts after a recurrent mixer: no native plan, so every step runs the modules
    (docs/models.md's feature table says so; tests/model/test_hybrid_families.py checks those steps against
    transformers)."""
    save_variant(name, tmp_path)
    model = load_model(tmp_path)
    with torch.inference_mode():
        assert fused.rows_plan(model, model.new_cache(1, 8)) is None
