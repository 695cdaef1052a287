"""The fused native step on every family's block (csrc/decode.cpp's switches): against a float64 run of the modules,
with quantized weights, and LongRoPE's per-row choice in the engine. tests/model/test_fused.py holds the token-for-token
comparisons with the modules and transformers (generate and the engine's rows, batch invariance) for every variant.
"""

from __future__ import annotations

import pytest
import torch

from nexttoken.generation import generate
from nexttoken.model import ForwardBatch, fused, kernels, load_model
from nexttoken.model.quant import quantize_bf16, quantize_int8
from support.fused import MODULES_ONLY
from support.tiny_models import RECURRENT, VARIANTS, build_hf_model, save_variant

pytestmark = pytest.mark.skipif(not kernels.available(), reason="native kernel unavailable (no g++ or no AVX-512)")

PROMPTS = torch.tensor([[1, 5, 17, 33, 9, 60], [1, 40, 41, 42, 43, 44], [1, 90, 3, 3, 8, 12]])


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """variant name -> its checkpoint folder, written once for this module."""
    made: dict[str, object] = {}

    def folder(name: str):  # noqa: ANN202
        if name not in made:
            made[name] = tmp_path_factory.mktemp(name)
            save_variant(name, made[name])
        return made[name]

    return folder


def native_calls(monkeypatch) -> list[bool]:
    """Whether each decode_step / greedy_chain call ran natively (True) or fell back (False)."""
    calls: list[bool] = []

    def counted(real):  # noqa: ANN001, ANN202
        def call(*args):  # noqa: ANN002, ANN202
            out = real(*args)
            calls.append(out is not None)
            return out
        return call

    for name in ("decode_step", "greedy_chain"):
        monkeypatch.setattr(fused, name, counted(getattr(fused, name)))
    return calls


@torch.inference_mode()
def forced_log_probs(model, ids: torch.Tensor, steps: int = 16) -> torch.Tensor:  # noqa: ANN001
    """(steps, B, V) float64 log-probs of `steps` decode steps after a 6-token prefill, each step fed the given next
    token (the same inputs for every run, whatever it would choose), past the sliding window of the variants with
    one (5 or 6 columns)."""
    B, P = ids.shape[0], 6
    S, window = P + steps, model.config.sliding_window
    valid = torch.ones(B, S, dtype=torch.bool)
    cache = model.new_cache(B, S)
    cols = torch.arange(P).expand(B, P)
    model(ids[:, :P], ForwardBatch.build(cols, cols, valid, P, window, write_start=0), cache)
    out = []
    for t in range(P, S):
        pos = torch.full((B, 1), t)
        batch = ForwardBatch.build(pos, pos, valid, t + 1, window, write_start=t)
        out.append(model(ids[:, t : t + 1], batch, cache).double().log_softmax(-1))
    return torch.stack(out)


@pytest.mark.parametrize("name", sorted(set(VARIANTS) - MODULES_ONLY - RECURRENT))  # the native step refuses those
def test_native_step_is_as_close_to_float64_as_the_modules(name, folders, monkeypatch) -> None:
    """16 teacher-forced steps of 2 rows: the native step's log-probs are within float32 rounding of the modules'
    computed in float64 (no further from them than the float32 modules are, with a margin for the different sum
    orders), and it picks the same top-1 token at every step. It must have run natively at every step."""
    model = load_model(folders(name))
    ids = torch.randint(5, model.config.vocab_size, (2, 22), generator=torch.Generator().manual_seed(3))
    calls = native_calls(monkeypatch)
    native = forced_log_probs(model, ids)
    assert calls and all(calls)
    with fused.disabled():
        modules = forced_log_probs(model, ids)
        exact = forced_log_probs(model.double(), ids)
    assert torch.equal(native.argmax(-1), modules.argmax(-1))
    native_error, modules_error = (native - exact).abs().max().item(), (modules - exact).abs().max().item()
    assert native_error <= 3 * modules_error + 1e-6, (native_error, modules_error)


@pytest.mark.parametrize("name", ["qwen3-qk-norm", "gemma3-local-global-rope", "gemma2-softcap-sliding",
                                  "qwen3-moe-norm-topk", "gpt-oss", "gemma4-kv-shared-ple", "gemma4-moe"])
@pytest.mark.parametrize("quantize", [quantize_int8, quantize_bf16], ids=["int8", "bf16"])
def test_quantized_weights_take_the_native_step(name, quantize, folders, monkeypatch) -> None:
    """int8 and bf16 weights (float32 activations) of the q/k-norm, Gemma and MoE blocks (gpt-oss's experts with
    their float32 biases): every decode step native, and the greedy tokens of the modules on the same weights, over
    20 steps, one row and three."""
    model = quantize(load_model(folders(name)))
    kwargs = dict(max_new_tokens=20, do_sample=False, eos_token_id=None)
    for rows in (1, 3):
        calls = native_calls(monkeypatch)
        fast = generate(model, PROMPTS[:rows], **kwargs)
        assert calls and all(calls)
        with fused.disabled():
            assert torch.equal(fast, generate(model, PROMPTS[:rows], **kwargs))


def test_longrope_rows_choose_their_frequencies_one_by_one_in_the_engine(tmp_path) -> None:
    """Phi-3's LongRoPE switches to the long frequencies once a sequence passes the original context (16 here).
    The engine's native rows each choose by their own position, mid-generation, at different steps in one batch:
    each row's tokens and log-probs equal those the modules give it alone."""
    from nexttoken.engine import EngineConfig, LLMEngine
    from nexttoken.generation.config import GenerationConfig

    _, overrides = VARIANTS["phi3-longrope-short"]
    hf = build_hf_model("phi3", **{**overrides, "original_max_position_embeddings": 16})
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path)
    prompts = [[1, 5, 17, 33, 9, 60], [1, 40], [1, 90, 3, 3, 8, 12, 7, 7, 7, 70, 71]]

    def run(batch: list[list[int]]) -> list:  # noqa: ANN202
        engine = LLMEngine(model, None, EngineConfig(max_num_seqs=4, max_model_len=64, chunk_size=8,
                                                     enable_prefix_caching=False))
        seqs = [engine.add_request(p, GenerationConfig(max_new_tokens=14, eos_token_id=None, top_k=None))
                for p in batch]
        while engine.has_unfinished():
            engine.step()
        return seqs

    together = run(prompts)
    with fused.disabled():
        alone = [run([p])[0] for p in prompts]
    for a, b in zip(together, alone):
        assert a.output_ids == b.output_ids
        assert a.out.logprobs == pytest.approx(b.out.logprobs, abs=1e-4)


@pytest.mark.parametrize("name", ["gemma2-softcap-sliding", "mixtral-moe", "gpt-oss", "gemma4-kv-shared-ple",
                                  "gemma4-moe"])
def test_engine_int8_kv_pool_with_a_window_takes_the_native_step(name, folders, monkeypatch) -> None:
    """The engine's native rows on an int8 KV pool (per token and head scales), past the sliding window (5 / 6
    columns), with Gemma 2's soft-caps, Mixtral's experts, gpt-oss's sinks or Gemma 4's per-layer shapes in slots
    as wide as its widest layer (KV-shared layers reading their source's blocks): every decode row native, and the
    modules' tokens."""
    from nexttoken.engine import EngineConfig, LLMEngine
    from nexttoken.generation.config import GenerationConfig

    model = load_model(folders(name))
    prompts = [[1, 5, 17, 33, 9, 60], [1, 40], [1, 90, 3, 3, 8, 12, 7, 7, 7, 70, 71]]

    def run() -> list:  # noqa: ANN202
        engine = LLMEngine(model, None, EngineConfig(max_num_seqs=4, max_model_len=64, chunk_size=8,
                                                     enable_prefix_caching=False, kv_cache_dtype="int8"))
        seqs = [engine.add_request(p, GenerationConfig(max_new_tokens=12, eos_token_id=None, top_k=None))
                for p in prompts]
        while engine.has_unfinished():
            engine.step()
        return seqs

    rows: list[bool] = []
    real = fused.decode_rows

    def counted(*args):  # noqa: ANN002, ANN202
        out = real(*args)
        rows.append(out is not None)
        return out

    monkeypatch.setattr(fused, "decode_rows", counted)
    native = run()
    assert rows and all(rows)
    with fused.disabled():
        modules = run()
    for a, b in zip(native, modules):
        assert a.output_ids == b.output_ids
        assert a.out.logprobs == pytest.approx(b.out.logprobs, abs=1e-4)


@pytest.mark.parametrize("name, part", [("gemma4-kv-shared-ple", "input_gate.weight"),
                                        ("gemma4-kv-shared-ple", "layer_scalar"), ("gemma4-moe", "experts.gate_up"),
                                        ("gemma4-moe", "experts.expert_scale")])
@torch.inference_mode()
def test_a_replaced_gemma4_tensor_rebuilds_the_description(name, part, folders, monkeypatch) -> None:
    """The native description holds the addresses of Gemma 4's own tensors too (the per-layer input's gate, the
    layer scalar, the stacked experts, their scales): one replaced between two native steps on the same cache is
    read at its new place, the modules' logits on the new weights within 1e-5."""
    model = load_model(folders(name))
    ids, P = PROMPTS[:1], 6
    valid = torch.ones(1, P + 2, dtype=torch.bool)
    cache = model.new_cache(1, P + 2)
    cols = torch.arange(P)[None]
    window = model.config.sliding_window
    model(ids[:, :P], ForwardBatch.build(cols, cols, valid, P, window, write_start=0), cache)

    def step(t: int) -> torch.Tensor:
        pos = torch.full((1, 1), t)
        return model(ids[:, t - P : t - P + 1], ForwardBatch.build(pos, pos, valid, t + 1, window, write_start=t),
                     cache)

    calls = native_calls(monkeypatch)
    step(P)  # a description of the old tensors
    owner, attr = model.layers[0].get_submodule(part.rpartition(".")[0]), part.rpartition(".")[2]
    old = getattr(owner, attr)
    setattr(owner, attr, torch.nn.Parameter(old.detach() * torch.linspace(-2.0, 2.0, old.numel()).view(old.shape)))
    fast = step(P + 1)
    assert calls == [True, True]
    with fused.disabled():
        torch.testing.assert_close(fast, step(P + 1), rtol=1e-5, atol=1e-5)
