"""SmolLM3 (Llama with no RoPE in every fourth layer), added through its declaration alone
(nexttoken/families/smollm3.py): the config read as transformers reads it, tokens identical to transformers through
`nexttoken.generate`, seeded sampling, the engine's rows on the native step, and GGUF files written as llama.cpp's
converter writes them (architecture `smollm3`, q / k rows permuted, no key for the NoPE layers). The suites that run
every variant of tests/support/tiny_models.py (test_fused*, test_generation_parity, test_tensor_parallel_models,
test_gguf_files) run the two SmolLM3 variants too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import nexttoken
from nexttoken.config import ModelConfig
from nexttoken.engine import EngineConfig, LLMEngine
from nexttoken.families import NOPE, SLIDING, LayerKind
from nexttoken.generation.config import GenerationConfig
from nexttoken.model import fused, kernels, load_model
from support.tiny_models import VARIANTS, build_hf_model, save_variant

needs_kernel = pytest.mark.skipif(not kernels.available(), reason="native kernel unavailable (no g++ or no AVX-512)")
PROMPTS = torch.tensor([[1, 5, 17, 33, 9, 60], [1, 40, 41, 42, 43, 44], [1, 90, 3, 3, 8, 12]])


@pytest.fixture(scope="module", params=["smollm3-nope", "smollm3-nope-sliding"])
def pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = save_variant(request.param, folder)
    return hf, load_model(folder), folder


def test_layer_kinds_are_transformers_no_rope_layers_and_layer_types() -> None:
    """Every layer's RoPE and window as transformers' SmolLM3Config derives them (no_rope_layers, layer_types),
    from its defaults, an interval, an explicit list, and a config.json naming only the model_type."""
    import transformers

    cases = [dict(num_hidden_layers=8), dict(num_hidden_layers=6, no_rope_layer_interval=3),
             dict(num_hidden_layers=4, no_rope_layers=[1, 0, 0, 1]),
             dict(num_hidden_layers=4, no_rope_layer_interval=2, use_sliding_window=True, sliding_window=7)]
    for overrides in cases:
        hf = transformers.SmolLM3Config(**overrides)
        raw = hf.to_dict()
        for config in (raw, {k: v for k, v in raw.items() if k != "architectures"}):
            ours = ModelConfig.from_dict(config)
            assert ours.architecture == "SmolLM3ForCausalLM"
            assert [k.rope is not None for k in ours.layers] == [bool(r) for r in hf.no_rope_layers]
            slides = [hf.use_sliding_window and t == "sliding_attention" for t in hf.layer_types]
            assert list(ours.sliding_layers) == slides
            assert ours.sliding_window == (hf.sliding_window if any(slides) else None)
    default = ModelConfig.from_dict(transformers.SmolLM3Config(num_hidden_layers=8).to_dict())
    assert default.layers == (LayerKind(),) * 3 + (NOPE,) + (LayerKind(),) * 3 + (NOPE,)
    sliding = ModelConfig.from_dict(transformers.SmolLM3Config(**cases[3]).to_dict())
    assert sliding.layers[1] == LayerKind(window=True, rope=None) != SLIDING


def test_a_bad_no_rope_list_is_refused() -> None:
    import transformers

    raw = transformers.SmolLM3Config(num_hidden_layers=4).to_dict() | {"no_rope_layers": [1, 0]}
    with pytest.raises(nexttoken.errors.ModelLoadError, match="no_rope_layers"):
        ModelConfig.from_dict(raw)


def test_the_nope_layers_change_the_tokens(tmp_path: Path) -> None:
    """The same weights with RoPE in every layer give other tokens (in transformers and here), so the parity
    below tests the NoPE layers and not luck."""
    _, overrides = VARIANTS["smollm3-nope"]
    nope = build_hf_model("smollm3", **overrides)
    rope = build_hf_model("smollm3", **overrides, no_rope_layers=[1, 1, 1, 1])
    kwargs = dict(max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert not torch.equal(nope.generate(PROMPTS, **kwargs), rope.generate(PROMPTS, **kwargs))
    rope.save_pretrained(tmp_path)
    assert torch.equal(nexttoken.generate(load_model(tmp_path), PROMPTS, **kwargs), rope.generate(PROMPTS, **kwargs))


def _native_calls(monkeypatch) -> list[bool]:  # noqa: ANN001
    calls: list[bool] = []
    for name in ("decode_step", "greedy_chain", "decode_rows"):
        real = getattr(fused, name)
        monkeypatch.setattr(fused, name, lambda *a, real=real: calls.append((out := real(*a)) is not None) or out)
    return calls


@needs_kernel
def test_generate_greedy_and_seeded_equal_transformers_on_the_native_step(pair, monkeypatch) -> None:
    hf, model, _ = pair
    assert any(b.attention.kind.rope is None for b in model.layers)
    for rows in (1, 3):
        calls = _native_calls(monkeypatch)
        greedy = dict(max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert torch.equal(nexttoken.generate(model, PROMPTS[:rows], **greedy), hf.generate(PROMPTS[:rows], **greedy))
        sampled = dict(max_new_tokens=24, do_sample=True, temperature=0.9, top_k=20, eos_token_id=None,
                       pad_token_id=0)
        torch.manual_seed(77)
        want = hf.generate(PROMPTS[:rows], **sampled)
        assert torch.equal(nexttoken.generate(model, PROMPTS[:rows], seed=77, **sampled), want)
        assert calls and all(calls), "the native step did not run every decode step"


@needs_kernel
def test_engine_rows_take_the_native_step_and_equal_transformers(pair, monkeypatch) -> None:
    hf, model, _ = pair
    prompts = [[1, 5, 17, 33, 9, 60], [1, 40], [1, 90, 3, 3, 8, 12, 7, 7, 7, 70, 71], [1, 2, 3]]
    calls = _native_calls(monkeypatch)
    engine = LLMEngine(model, None, EngineConfig(chunk_size=4, max_num_seqs=4))
    seqs = engine.generate(prompts, GenerationConfig(eos_token_id=None, top_k=None, max_new_tokens=12))
    assert calls and all(calls)
    for prompt, seq in zip(prompts, seqs):
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(prompt):].tolist()
        assert seq.output_ids == want, prompt


def test_llm_folder_greedy_equals_transformers(pair) -> None:
    hf, _, folder = pair
    llm = nexttoken.load(folder)
    ids = [5, 17, 33, 8, 61, 2, 40, 12]
    want = hf.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                       pad_token_id=0)[0, len(ids):].tolist()
    assert llm.generate(ids, max_new_tokens=10, ignore_eos=True).token_ids == want


# ---- GGUF, as llama.cpp's converter writes it ------------------------------------------------------------------


def test_gguf_names_are_llama_cpps() -> None:
    """The declaration's GGUF architecture and the tensors the converter writes for it (the installed gguf
    package's tables): llama's names, q / k among them."""
    gguf = pytest.importorskip("gguf")
    from nexttoken.families import BY_GGUF

    arch = gguf.MODEL_ARCH.SMOLLM3
    assert BY_GGUF[gguf.MODEL_ARCH_NAMES[arch]].architecture == "SmolLM3ForCausalLM"
    assert set(gguf.MODEL_TENSORS[arch]) <= set(gguf.MODEL_TENSORS[gguf.MODEL_ARCH.LLAMA])
    names = gguf.get_tensor_name_map(arch, 4)
    assert names.get_name("model.layers.3.self_attn.q_proj") == "blk.3.attn_q"
    assert names.get_name("model.layers.3.mlp.gate_proj") == "blk.3.ffn_gate"


@pytest.mark.parametrize("quant", [None, "Q8_0"])
def test_gguf_file_gives_transformers_tokens_and_packed_agrees(quant, tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("gguf")
    from support.gguf_writer import reference_tokens, write_model

    _, overrides = VARIANTS["smollm3-nope"]
    hf = build_hf_model("smollm3", **overrides)
    path = tmp_path / "smollm3.gguf"
    held = write_model(path, "smollm3", hf, quant)
    ids = [5, 17, 33, 8, 61, 2, 40, 12]
    exact = nexttoken.load(path, dequantize=True)
    assert exact.model.config.architecture == "SmolLM3ForCausalLM"
    assert [b.attention.kind.rope is None for b in exact.model.layers] == [False, False, False, True]
    want = reference_tokens(hf, held, ids, 10)  # transformers on exactly the values the file holds
    assert exact.generate(ids, max_new_tokens=10, ignore_eos=True).token_ids == want
    if quant is None or not kernels.ggml_available():
        return
    from nexttoken.bench.accuracy import all_logits
    from nexttoken.model.quant import tiles
    from nexttoken.model.quant.ggml import GGUFLinear

    packed = nexttoken.load(path)  # the blocks kept packed, multiplied natively
    assert isinstance(packed.model.layers[3].attention.wqkv, GGUFLinear)
    long = ids + [9, 30, 3, 7, 1, 19, 22, 50, 11, 4]  # > 16 rows: a prefill of exactly dequantized tiles
    with tiles.precision("float32"):  # in float32: the float model's logits up to summation order
        assert torch.allclose(all_logits(packed.model, long, chunk=len(long)),
                              all_logits(exact.model, long, chunk=len(long)), atol=1e-4, rtol=1e-4)
    calls = _native_calls(monkeypatch)
    fast = packed.generate(ids, max_new_tokens=10, ignore_eos=True).token_ids
    assert calls and all(calls)
    with fused.disabled():
        assert packed.generate(ids, max_new_tokens=10, ignore_eos=True).token_ids == fast
