"""LoRA adapters (docs/lora.md) against PEFT itself: adapters made by `peft` on tiny random models with random,
non-zero B matrices, saved with save_pretrained (safetensors), read by nexttoken; greedy tokens equal to
transformers + PEFT's PeftModel.generate and first-step logits within float32 rounding, merged and unmerged; a
batch of requests over three adapters and the base gives each its solo output (float32, bf16, int8, int4); the
prefix cache never hands one adapter's K/V to another; clear errors for bad adapters."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import nexttoken
from nexttoken.engine import EngineConfig, LLMEngine
from nexttoken.errors import LoraError, MissingFileError, UnknownLoraError
from nexttoken.generation.config import GenerationConfig
from nexttoken.model import ForwardBatch, load_model
from nexttoken.model.lora import read_adapter

from support.tiny_models import save_variant
from support.lora import FAMILIES, PROMPTS, make_adapter, peft_greedy, peft_model

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")









@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """variant -> (base folder, [three adapter folders])."""
    root = tmp_path_factory.mktemp("lora")
    out = {}
    for variant, options in FAMILIES.items():
        base = root / variant
        hf = save_variant(variant, base)
        out[variant] = (base, [make_adapter(hf, root / f"{variant}-{i}", seed=i, **options) for i in range(3)])
    return out


@pytest.mark.parametrize("variant", list(FAMILIES))
def test_greedy_tokens_and_logits_match_peft(family, variant: str) -> None:
    base, adapters = family[variant]
    ref = peft_model(base, adapters[0])
    llm = nexttoken.load(base, lora={"a": adapters[0]})
    merged = nexttoken.load(base, lora={"a": adapters[0]}, merge=True)
    plain = nexttoken.load(base)
    changed = False
    for prompt in PROMPTS[:3]:
        want = peft_greedy(ref, prompt, 8)
        got = llm.generate(prompt, lora="a", max_new_tokens=8, min_new_tokens=8).token_ids
        assert got == want, (variant, prompt)
        assert merged.generate(prompt, max_new_tokens=8, min_new_tokens=8).token_ids == want
        changed |= plain.generate(prompt, max_new_tokens=8, min_new_tokens=8).token_ids != want
    assert changed, "the adapter should change the base model's tokens"
    # first-step logits, unmerged (the per-row product) and merged, against PeftModel's forward
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        want = ref(ids).logits[0, -1]
    for model, slots in ((llm.model, torch.tensor([0])), (merged.model, None)):
        logits = _forward(model, ids, slots)
        torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)


def _forward(model, ids: torch.Tensor, slots: torch.Tensor | None) -> torch.Tensor:  # noqa: ANN001
    T = ids.shape[1]
    cols = torch.arange(T)[None]
    batch = ForwardBatch.build(cols, cols, torch.ones(1, T, dtype=torch.bool), T, None, write_start=0)
    batch.lora = slots
    with torch.no_grad():
        return model(ids, batch, model.new_cache(1, T))[0].float()


def _engine(llm, prefix_caching: bool = False, chunk_size: int = 4) -> LLMEngine:  # noqa: ANN001
    config = EngineConfig(max_num_seqs=8, max_model_len=128, chunk_size=chunk_size,
                          enable_prefix_caching=prefix_caching)
    return LLMEngine(llm.model, None, config, llm.generation_config)


def _run(engine: LLMEngine, requests: list[tuple[list[int], str | None]], n: int = 10) -> list[list[int]]:
    params = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False)
    seqs = [engine.add_request(p, params, lora=name) for p, name in requests]
    while engine.has_unfinished():
        engine.step()
    return [s.output_ids for s in seqs]


@pytest.mark.parametrize("quantize", [None, "bf16", "int8", "int4"])
def test_a_batch_of_three_adapters_and_the_base_gives_each_its_solo_output(family, quantize) -> None:
    base, adapters = family["llama-gqa"]
    llm = nexttoken.load(base, lora={f"a{i}": a for i, a in enumerate(adapters)}, quantize=quantize)
    requests = [(p, name) for p in PROMPTS for name in ("a0", "a1", "a2", None)]
    together = _run(_engine(llm), requests)
    solo = [_run(_engine(llm), [r])[0] for r in requests]
    assert together == solo
    # the adapters matter: each prompt's four outputs are not all the same
    assert all(len({tuple(t) for t in together[i : i + 4]}) > 1 for i in range(0, len(requests), 4))
    if quantize is None:  # the float base: each adapter's rows are PEFT's tokens
        ref = peft_model(base, adapters[1])
        assert together[1][:8] == peft_greedy(ref, PROMPTS[0], 8)


def test_the_prefix_cache_keys_by_adapter(family) -> None:
    base, adapters = family["llama-gqa"]
    llm = nexttoken.load(base, lora={"a": adapters[0], "b": adapters[1]})
    prompt = PROMPTS[1] + [9, 10, 11, 12]  # three full chunks of 4 before the last token
    engine = _engine(llm, prefix_caching=True)
    first = _run(engine, [(prompt, "a")])[0]
    assert engine.blocks.hit_tokens == 0
    other = _run(engine, [(prompt, "b")])[0]
    assert engine.blocks.hit_tokens == 0, "adapter b must not reuse adapter a's prefix"
    assert other == _run(_engine(llm), [(prompt, "b")])[0] != first
    again = _run(engine, [(prompt, "a")])[0]
    assert engine.blocks.hit_tokens == 12 and again == first
    base_run = _run(engine, [(prompt, None)])[0]
    assert engine.blocks.hit_tokens == 12 and base_run == _run(_engine(llm), [(prompt, None)])[0]
    # a name unloaded and loaded again with other weights never meets its old prefixes
    engine.unload_lora("a")
    engine.load_lora("a", adapters[2])
    assert _run(engine, [(prompt, "a")])[0] == _run(_engine(llm), [(prompt, "a")])[0]
    assert engine.blocks.hit_tokens == 12


def test_merging_into_a_quantized_base_rounds_like_the_quantized_base(family) -> None:
    """merge=True with quantize merges into the float weights, then quantizes; merge_adapter on an int8 model
    dequantizes, merges and requantizes. Either is as far from the float adapter's logits as int8 rounding puts
    the int8 base from the float base: the merged weights carry the scheme's rounding, nothing more."""
    from nexttoken.model.lora import merge_adapter
    from nexttoken.model.quant.quantize import apply_quantization

    base, adapters = family["llama-gqa"]
    ids = torch.tensor([PROMPTS[1]])
    adapter = _forward(nexttoken.load(base, lora={"a": adapters[0]}).model, ids, torch.tensor([0]))
    rounding = (_forward(apply_quantization(load_model(base), "int8"), ids, None)
                - _forward(load_model(base), ids, None)).abs().max()
    merged_first = _forward(nexttoken.load(base, lora={"a": adapters[0]}, merge=True, quantize="int8").model, ids,
                            None)
    model = apply_quantization(load_model(base), "int8")
    merge_adapter(model, read_adapter("a", adapters[0], model.config))
    requantized = _forward(model, ids, None)
    for logits in (merged_first, requantized):
        assert 0 < (logits - adapter).abs().max() < 2 * rounding


def test_load_and_unload_at_run_time(family) -> None:
    base, adapters = family["phi3-plain"]
    llm = nexttoken.load(base, max_loras=2, max_lora_rank=8)
    assert llm.loras == []
    llm.load_lora("x", adapters[0])
    want = peft_greedy(peft_model(base, adapters[0]), PROMPTS[0], 6)
    assert llm.generate(PROMPTS[0], lora="x", max_new_tokens=6, min_new_tokens=6).token_ids == want
    llm.load_lora("y", adapters[1])
    with pytest.raises(LoraError, match="limit"):
        llm.load_lora("z", adapters[2])
    llm.unload_lora("x")
    assert llm.loras == ["y"]
    with pytest.raises(UnknownLoraError, match="'x' is not loaded"):
        llm.generate(PROMPTS[0], lora="x", max_new_tokens=2)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_bad_adapters_are_refused_clearly(family, tmp_path: Path) -> None:
    base, adapters = family["llama-gqa"]
    cfg = load_model(base).config
    with pytest.raises(LoraError, match="rank 4, above the limit 2"):
        read_adapter("a", adapters[0], cfg, max_rank=2)
    damaged = _copy(adapters[0], tmp_path / "damaged")
    data = (damaged / "adapter_model.safetensors").read_bytes()
    (damaged / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(LoraError, match="damaged"):
        read_adapter("a", damaged, cfg)
    pickled = _copy(adapters[0], tmp_path / "pickled")
    (pickled / "adapter_model.safetensors").rename(pickled / "adapter_model.bin")
    with pytest.raises(MissingFileError, match="safetensors only"):
        read_adapter("a", pickled, cfg)
    saved = _copy(adapters[0], tmp_path / "saved")
    config = json.loads((saved / "adapter_config.json").read_text())
    (saved / "adapter_config.json").write_text(json.dumps({**config, "modules_to_save": ["lm_head"]}))
    with pytest.raises(LoraError, match="modules_to_save"):
        read_adapter("a", saved, cfg)
    dora = _copy(adapters[0], tmp_path / "dora")
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(LoraError, match="DoRA"):
        read_adapter("a", dora, cfg)
    other = load_model(family["qwen3-qk-norm"][0]).config
    with pytest.raises(LoraError, match="another model"):
        read_adapter("a", adapters[0], other)
    with pytest.raises(MissingFileError, match="does not exist"):
        read_adapter("a", tmp_path / "nowhere", cfg)
    with pytest.raises(LoraError, match="exactly one"):
        nexttoken.load(base, lora={"a": adapters[0], "b": adapters[1]}, merge=True)
    llm = nexttoken.load(base, lora={"a": adapters[0]})
    with pytest.raises(UnknownLoraError, match="'nope' is not loaded"):
        llm.generate(PROMPTS[0], lora="nope")
    with pytest.raises(Exception, match="lora= works with greedy"):
        llm.generate(PROMPTS[0], lora="a", num_beams=2)


def test_an_embedding_adapter_is_refused(family, tmp_path: Path) -> None:
    base, _ = family["llama-gqa"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(base)
    folder = make_adapter(hf, tmp_path / "embed", seed=0, r=2, lora_alpha=2, target_modules=["embed_tokens"])
    with pytest.raises(LoraError, match="embedding or the LM head"):
        read_adapter("e", folder, load_model(base).config)


def test_smollm2_adapters_match_peft_token_for_token(smollm2_dir: Path, tmp_path: Path) -> None:
    """A real instruction model: two PEFT adapters (every projection, ranks 8 and 16, one rsLoRA) on SmolLM2-135M;
    a batch of both adapters and the base gives PeftModel's greedy tokens for each, and merging gives the same."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, attn_implementation="eager").eval()
    folders = [make_adapter(hf, tmp_path / "a", seed=0, r=8, lora_alpha=16, target_modules="all-linear"),
               make_adapter(hf, tmp_path / "b", seed=1, r=16, lora_alpha=8, use_rslora=True,
                            target_modules=["q_proj", "v_proj", "down_proj"])]
    llm = nexttoken.load(smollm2_dir, lora={"a": folders[0], "b": folders[1]})
    prompt = llm.chat_prompt([{"role": "user", "content": "Name a colour."}])
    got = _run(_engine(llm, chunk_size=64), [(prompt, "a"), (prompt, "b"), (prompt, None)], n=8)
    want = []
    for folder in folders:
        model = peft.PeftModel.from_pretrained(hf, folder).eval()
        want.append(peft_greedy(model, prompt, 8))
        hf = model.unload()
    want.append(peft_greedy(hf, prompt, 8))
    assert got == want
    assert len({tuple(w) for w in want}) == 3
    merged = nexttoken.load(smollm2_dir, lora={"b": folders[1]}, merge=True)
    assert merged.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False).token_ids == want[1]


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen3-qk-norm"])
def test_adapter_rows_take_the_native_step_and_equal_the_modules(family, variant: str, monkeypatch) -> None:
    """The engine's native rows add each row's adapter products (csrc/decode.cpp's add_lora): three adapters and
    the base in one batch run natively, and give the tokens and log-probs of the modules' per-row LoRA."""
    if variant not in family:
        pytest.skip(f"{variant} has no adapters in this module")
    from nexttoken.model import fused, kernels

    if not kernels.available():
        pytest.skip("native kernel unavailable")
    base, adapters = family[variant]
    llm = nexttoken.load(base, lora={f"a{i}": a for i, a in enumerate(adapters)})
    requests = [(p, name) for p in PROMPTS[:2] for name in ("a0", "a1", "a2", None)]
    params = GenerationConfig(max_new_tokens=10, min_new_tokens=10, do_sample=False)

    def run() -> list:  # noqa: ANN202
        engine = _engine(llm)
        seqs = [engine.add_request(p, params, lora=name) for p, name in requests]
        while engine.has_unfinished():
            engine.step()
        return seqs

    adapter_rows: list[int] = []
    real = fused.decode_rows

    def counted(*args):  # noqa: ANN002, ANN202
        out = real(*args)
        assert out is not None
        if args[6] is not None:
            adapter_rows.append(int((args[6] >= 0).sum()))
        return out

    monkeypatch.setattr(fused, "decode_rows", counted)
    native = run()
    assert sum(adapter_rows) >= 6 * 9  # every adapter row's decode steps ran natively
    with fused.disabled():
        modules = run()
    for a, b in zip(native, modules):
        assert a.output_ids == b.output_ids
        assert a.out.logprobs == pytest.approx(b.out.logprobs, abs=1e-4)
