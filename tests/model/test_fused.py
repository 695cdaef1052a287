"""The fused native decode step (csrc/decode.cpp) against the PyTorch modules and against transformers."""

from __future__ import annotations

import pytest
import torch

from nexttoken.generation import generate
from nexttoken.model import fused, kernels, load_model
from nexttoken.model.quant import quantize_int8
from support.tiny_models import RECURRENT, VARIANTS, save_variant
from support.fused import MODULES_ONLY, step_logits

# Only the tests that compare against the native step need it; the others hold with or without it.
needs_kernel = pytest.mark.skipif(not kernels.available(), reason="native kernel unavailable (no g++ or no AVX-512)")


# Unpadded prompts of one length: every decode step is a plain one, the case the fused step takes.
PROMPTS = torch.tensor([[1, 5, 17, 33, 9, 60], [1, 40, 41, 42, 43, 44], [1, 90, 3, 3, 8, 12]])


@pytest.fixture(scope="module", params=sorted(set(VARIANTS) - RECURRENT))  # the native step refuses those
def variant(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf = save_variant(request.param, directory)
    return request.param, hf, load_model(directory)


def count_fused_steps(monkeypatch) -> list[int]:
    """Whether each native call ran: one step (decode_step) or a chain of greedy steps (greedy_chain, which a
    plain greedy call of one row takes after its first step)."""
    calls: list[int] = []
    real_step, real_chain = fused.decode_step, fused.greedy_chain

    def counting(*args):  # noqa: ANN002, ANN202
        out = real_step(*args)
        calls.append(out is not None)
        return out

    def counting_chain(*args):  # noqa: ANN002, ANN202
        out = real_chain(*args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(fused, "decode_step", counting)
    monkeypatch.setattr(fused, "greedy_chain", counting_chain)
    return calls


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3])
def test_greedy_tokens_equal_the_modules(variant, rows, monkeypatch) -> None:
    name, _, model = variant
    kwargs = dict(max_new_tokens=24, do_sample=False, eos_token_id=None)
    calls = count_fused_steps(monkeypatch)
    fast = generate(model, PROMPTS[:rows], **kwargs)
    with fused.disabled():
        reference = generate(model, PROMPTS[:rows], **kwargs)
    assert torch.equal(fast, reference)
    # Sliding-window layers and q/k norms keep the modules; the rest fuse.
    assert any(calls) == (name not in MODULES_ONLY)


def test_greedy_tokens_equal_transformers(variant) -> None:
    """The independent reference: transformers' generate on the same weights, one unpadded prompt."""
    _, hf, model = variant
    ids = PROMPTS[:1]
    expected = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    assert torch.equal(generate(model, ids, max_new_tokens=24, do_sample=False, eos_token_id=None), expected)




@needs_kernel
def test_step_logits_match_the_modules_within_float32_rounding(variant) -> None:
    _, _, model = variant
    with fused.disabled():
        reference = step_logits(model)
    got = step_logits(model)
    torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_seeded_sampling_equals_the_modules(variant) -> None:
    _, _, model = variant
    kwargs = dict(max_new_tokens=24, do_sample=True, temperature=0.9, top_k=20, seed=11, eos_token_id=None)
    fast = generate(model, PROMPTS, **kwargs)
    with fused.disabled():
        assert torch.equal(fast, generate(model, PROMPTS, **kwargs))


@needs_kernel
def test_int8_model_fuses_and_keeps_its_tokens(tmp_path, monkeypatch) -> None:
    save_variant("llama-gqa", tmp_path)
    model = quantize_int8(load_model(tmp_path))
    calls = count_fused_steps(monkeypatch)
    kwargs = dict(max_new_tokens=20, do_sample=False, eos_token_id=None)
    fast = generate(model, PROMPTS, **kwargs)
    with fused.disabled():
        reference = generate(model, PROMPTS, **kwargs)
    assert all(calls) and calls
    assert torch.equal(fast, reference)


def test_padding_bfloat16_and_grad_take_the_modules(tmp_path, monkeypatch) -> None:
    save_variant("llama-gqa", tmp_path)
    model = load_model(tmp_path)
    calls = count_fused_steps(monkeypatch)
    padded = torch.tensor([[0, 0, 1, 5, 17, 33], [1, 40, 41, 42, 43, 44]])
    generate(model, padded, attention_mask=(padded != 0).long(), max_new_tokens=4, do_sample=False, pad_token_id=0)
    generate(model.to(torch.bfloat16), PROMPTS, max_new_tokens=4, do_sample=False)
    assert calls == []  # applies() said no before decode_step was reached


@needs_kernel
def test_a_new_cache_or_new_weights_rebuild_the_description(tmp_path) -> None:
    """The native description holds raw addresses: a cache of another length, or replaced weights, must not reuse it."""
    save_variant("llama-gqa", tmp_path)
    model = load_model(tmp_path)
    short = generate(model, PROMPTS[:1], max_new_tokens=5, do_sample=False, eos_token_id=None)
    longer = generate(model, PROMPTS[:1], max_new_tokens=30, do_sample=False, eos_token_id=None)
    assert torch.equal(longer[:, : short.shape[1]], short)
    with torch.no_grad():
        model.layers[0].mlp.w2.weight = torch.nn.Parameter(torch.zeros_like(model.layers[0].mlp.w2.weight))
    fast = generate(model, PROMPTS[:1], max_new_tokens=12, do_sample=False, eos_token_id=None)
    with fused.disabled():
        reference = generate(model, PROMPTS[:1], max_new_tokens=12, do_sample=False, eos_token_id=None)
    assert torch.equal(fast, reference)


@needs_kernel
def test_the_plan_rechecks_what_it_read_and_holds_no_cache(tmp_path) -> None:
    """Each step checks the reads the description was built from (fused._Reads) instead of walking the model: a
    tensor whose storage moved in place (`.data =`), a module swapped in its parent's dict, or a weight replaced
    must each give a new description, and the logits then equal the modules'. The plan keeps no cache alive."""
    import gc
    import weakref

    save_variant("llama-gqa", tmp_path)
    model = load_model(tmp_path)
    with torch.inference_mode():
        step_logits(model)
    plan = model._fused_plan
    gc.collect()
    assert plan.reads.holds() and not any(t.dim() == 5 for t in plan.reads.tensors)  # no cache tensor among them

    def replaced(change) -> None:  # noqa: ANN001
        before = model._fused_plan
        with torch.no_grad():
            change()
        assert not before.reads.holds()
        with torch.inference_mode():
            fast = step_logits(model)
            assert model._fused_plan is not before
            with fused.disabled():
                torch.testing.assert_close(fast, step_logits(model), rtol=1e-5, atol=1e-5)

    wo = model.layers[1].attention.wo
    replaced(lambda: setattr(wo.weight, "data", wo.weight.data * 0.5))  # storage moved, same Parameter
    replaced(lambda: model.layers[0].attention._modules.__setitem__("wo", torch.nn.Linear(
        wo.in_features, wo.out_features, bias=False)))  # a module swapped in the parent's dict
    replaced(lambda: setattr(model.layers[0].mlp.w2, "weight", torch.nn.Parameter(
        torch.zeros_like(model.layers[0].mlp.w2.weight))))

    cache = model.new_cache(1, 12)
    ref = weakref.ref(cache.k)
    with torch.inference_mode():
        P = 6
        ids = torch.tensor([[1, 5, 17, 33, 9, 60, 7]])
        valid = torch.ones(1, 12, dtype=torch.bool)
        cols = torch.arange(P)[None]
        from nexttoken.model.batch import ForwardBatch

        model(ids[:, :P], ForwardBatch.build(cols, cols, valid, P, None, write_start=0), cache)
        pos = torch.full((1, 1), P)
        model(ids[:, P:], ForwardBatch.build(pos, pos, valid, P + 1, None, write_start=P), cache)
    del cache
    gc.collect()
    assert ref() is None  # the description's plan does not keep the cache it was built for


# ---- the engine's per-row native step -----------------------------------------------------------------------------

def _engine_run(model, prompts: list[list[int]], steps: int) -> list:
    from nexttoken.engine import EngineConfig, LLMEngine
    from nexttoken.generation.config import GenerationConfig

    engine = LLMEngine(model, None, EngineConfig(max_num_seqs=len(prompts), max_model_len=128, chunk_size=8,
                                                 enable_prefix_caching=False))
    options = GenerationConfig(max_new_tokens=steps, eos_token_id=None, top_k=None)
    seqs = [engine.add_request(p, options) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    return seqs


ENGINE_PROMPTS = [[1, 5, 17, 33, 9, 60], [1, 40], [1, 90, 3, 3, 8, 12, 7, 7, 7, 70, 71], [1, 2, 3]]


@needs_kernel
def test_engine_rows_take_the_native_step_and_equal_the_modules_and_transformers(variant, monkeypatch) -> None:
    name, hf, model = variant
    calls: list[int] = []
    real = fused.decode_rows
    monkeypatch.setattr(fused, "decode_rows", lambda *a: calls.append(a[2].shape[0]) or real(*a))
    native = _engine_run(model, ENGINE_PROMPTS, 12)
    with torch.inference_mode():
        takes_native = fused.rows_plan(model, model.new_cache(1, 8)) is not None
    assert bool(calls) == takes_native == (name not in MODULES_ONLY)
    with fused.disabled():
        modules = _engine_run(model, ENGINE_PROMPTS, 12)
    for prompt, a, b in zip(ENGINE_PROMPTS, native, modules):
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(prompt):].tolist()
        assert a.output_ids == b.output_ids == want
        # float32 rounding of different sum orders over 12 steps (up to 5e-5 on Phi-3's scaled LongRoPE, Mixtral's
        # experts); test_fused_families.py holds both to a float64 run of the modules
        assert a.out.logprobs == pytest.approx(b.out.logprobs, abs=1e-4)


@needs_kernel
def test_engine_native_rows_do_not_depend_on_batch_mates(variant) -> None:
    """Each row alone and among 3 others of other lengths (different slots, different groupings): the same bits."""
    _, _, model = variant
    together = _engine_run(model, ENGINE_PROMPTS, 10)
    for prompt, seq in zip(ENGINE_PROMPTS, together):
        (alone,) = _engine_run(model, [prompt], 10)
        assert alone.output_ids == seq.output_ids and alone.out.logprobs == seq.out.logprobs


@needs_kernel
def test_engine_rows_look_their_tokens_up_natively_and_an_id_outside_the_table_is_named(tmp_path) -> None:
    """The engine's native rows read the token table themselves (nt_decode_rows_ids): the same logits as with the
    embeddings computed by the module (a forward hook on it makes decode_rows take that path); an id outside the
    table is refused before anything is written, and the module's lookup then names it."""
    save_variant("llama-gqa", tmp_path)
    model = load_model(tmp_path)
    ids, positions, slots, kv_lens = torch.tensor([[5], [40]]), torch.tensor([0, 0]), torch.tensor([0, 1]), \
        torch.tensor([1, 1])
    with torch.inference_mode():
        cache = model.new_cache(2, 8)
        plan = fused.rows_plan(model, cache)
        assert plan is not None and fused._reads_table(plan, model)
        native = fused.decode_rows(plan, model, ids, positions, slots, kv_lens)
        hook = model.embed.register_forward_hook(lambda m, i, o: o)
        assert not fused._reads_table(plan, model)
        embedded = fused.decode_rows(plan, model, ids, positions, slots, kv_lens)
        hook.remove()
        assert native is not None and torch.equal(native, embedded)
        with pytest.raises(IndexError):
            fused.decode_rows(plan, model, torch.tensor([[5], [model.config.vocab_size]]), positions, slots, kv_lens)
