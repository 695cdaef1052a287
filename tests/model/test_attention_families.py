"""The attention families of 2026 added through their declarations (issue 42): Gemma 4's text model
(families/gemma4.py, its decoder model/gemma4.py), GLM-4.5 / 4.6 MoE (families/glm.py), OLMo 3
(families/olmo3.py), EXAONE 4 (families/exaone.py). Their configs read as transformers
reads them; greedy and seeded tokens identical to transformers through `nexttoken.generate` and the engine, batch
invariant; each optional part changes the tokens (so the parity tests it); GLM-4 MoE from a GGUF file written by
llama.cpp's own converter. The suites that run every variant of tests/support/tiny_models.py (test_fused*,
test_generation_parity, test_speculative, test_tensor_parallel_*) run these variants too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import nexttoken
from nexttoken.config import ModelConfig
from nexttoken.engine import EngineConfig, LLMEngine
from nexttoken.families import NOPE, SLIDING, LOCAL_SLIDING
from nexttoken.generation.config import GenerationConfig
from nexttoken.model import fused, load_model
from support.fused import MODULES_ONLY
from support.tiny_models import VARIANTS, build_hf_model, save_variant

NAMES = ["gemma4-kv-shared-ple", "gemma4-moe", "glm4-moe-groups", "olmo3-sliding", "exaone4-sliding-nope",
         "ernie4_5-pairs-bias", "ernie4_5-moe"]
PROMPTS = torch.tensor([[1, 5, 17, 33, 9, 60, 7, 8], [1, 40, 41, 42, 43, 44, 45, 46], [1, 90, 3, 3, 8, 12, 70, 71]])
GREEDY = dict(max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)


@pytest.fixture(scope="module", params=NAMES)
def pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = save_variant(request.param, folder)
    return request.param, hf, load_model(folder), folder


# ---- configs ---------------------------------------------------------------------------------------------------


def test_glm4_moe_config_is_transformers() -> None:
    import transformers

    hf = transformers.Glm4MoeConfig(num_hidden_layers=5, first_k_dense_replace=2, n_routed_experts=16, n_group=4,
                                    topk_group=2, num_experts_per_tok=3, n_shared_experts=2, moe_intermediate_size=48,
                                    routed_scaling_factor=2.5, attention_bias=True, use_qk_norm=True, head_dim=64)
    raw = hf.to_dict()
    for config in (raw, {k: v for k, v in raw.items() if k != "architectures"}):
        ours = ModelConfig.from_dict(config)
        assert ours.architecture == "Glm4MoeForCausalLM"
        moe = ours.moe
        assert moe.sparse_layers == (False, False, True, True, True)
        assert (moe.num_experts, moe.top_k, moe.n_group, moe.topk_group) == (16, 3, 4, 2)
        assert moe.shared_intermediate_size == 96 and not moe.shared_gate and moe.correction_bias
        assert moe.scoring == "sigmoid" and moe.routed_scaling_factor == 2.5 and moe.norm_topk_prob
        assert ours.qkv_bias and not ours.attention_bias and ours.qk_norm == "head"
        assert ours.rope.partial_rotary_factor == hf.rope_parameters["partial_rotary_factor"] == 0.5


def test_glm4_moe_bad_groups_are_refused() -> None:
    import transformers

    raw = transformers.Glm4MoeConfig(n_routed_experts=8, n_group=3).to_dict()
    with pytest.raises(nexttoken.errors.ModelLoadError, match="n_group"):
        ModelConfig.from_dict(raw)


def test_olmo3_and_exaone4_layer_kinds_are_transformers_layer_types() -> None:
    import transformers

    for overrides in (dict(num_hidden_layers=8), dict(num_hidden_layers=4, sliding_window=None),
                      dict(num_hidden_layers=3, layer_types=["full_attention", "sliding_attention", "full_attention"])):
        hf = transformers.Olmo3Config(**overrides)
        ours = ModelConfig.from_dict(hf.to_dict())
        slides = [hf.sliding_window is not None and t == "sliding_attention" for t in hf.layer_types]
        assert list(ours.sliding_layers) == slides and ours.norm_after and ours.qk_norm == "projection"
        assert all(k.rope == "global" for k in ours.layers)  # one RoPE base for both kinds by default
    local = ModelConfig.from_dict(transformers.Olmo3Config(**VARIANTS["olmo3-sliding"][1]).to_dict())
    assert local.layers == (LOCAL_SLIDING,) * 3 + (local.layer(3),) and local.layer(3).rope == "global"
    assert local.rope_local.theta == 10.0 and local.rope.theta == 500_000.0
    hf = transformers.Exaone4Config(num_hidden_layers=8, sliding_window=16)
    ours = ModelConfig.from_dict(hf.to_dict())
    assert ours.layers == tuple(SLIDING if t == "sliding_attention" else NOPE for t in hf.layer_types)
    assert ours.qk_norm == "head" and ours.norm_after
    plain = ModelConfig.from_dict(transformers.Exaone4Config(num_hidden_layers=2, sliding_window=None,
                                                             layer_types=["full_attention"] * 2).to_dict())
    assert all(k.rope == "global" and not k.window for k in plain.layers)


def test_gemma4_config_is_transformers() -> None:
    """Per-layer shapes, keys-as-values, KV sharing and the per-layer inputs as transformers derives them, from
    global_head_dim (a Hub config) and from the per_layer_config transformers saves; the caches' layout."""
    import transformers

    hf = transformers.Gemma4TextConfig(num_hidden_layers=12, head_dim=256, global_head_dim=512, num_key_value_heads=8,
                                       num_global_key_value_heads=2, attention_k_eq_v=True, num_kv_shared_layers=4,
                                       hidden_size_per_layer_input=256)
    for raw in (hf.to_dict(), {**{k: v for k, v in hf.to_dict().items() if k != "per_layer_config"},
                               "global_head_dim": 512, "num_global_key_value_heads": 2}):
        ours = ModelConfig.from_dict(raw)
        assert list(ours.sliding_layers) == [t == "sliding_attention" for t in hf.layer_types]
        assert (ours.global_head_dim, ours.global_kv_heads, ours.values_from_keys) == (512, 2, True)
        assert ours.kv_layout == (8, 8, 512)  # no slots for the 4 shared layers; slots as wide as the widest
        assert ours.rope.type == "proportional" and ours.rope.partial_rotary_factor == 0.25
    from nexttoken.model.gemma4 import kv_sources

    modes = hf.kv_sharing_modes  # transformers: "reuse" layers read the last "store" layer of their type
    sources = kv_sources(ModelConfig.from_dict(hf.to_dict()))
    for i, mode in enumerate(modes):
        assert (sources[i] is not None) == (mode == "reuse")
        if mode == "reuse":
            assert modes[sources[i]] == "store" and hf.layer_types[sources[i]] == hf.layer_types[i]


def test_gemma4_shared_layers_keep_no_cache(tmp_path: Path) -> None:
    """The KV-shared layers have no slot in the slot cache nor in the engine's pool: the cache holds the other
    layers only, each slot as wide as the widest layer."""
    save_variant("gemma4-kv-shared-ple", tmp_path)
    model = load_model(tmp_path)
    cfg = model.config
    assert cfg.kv_shared_layers == 2 and cfg.global_head_dim == 32 != cfg.head_dim
    cache = model.new_cache(2, 16)
    assert cache.k.shape[0] == cfg.num_hidden_layers - cfg.kv_shared_layers
    engine = LLMEngine(model, None, EngineConfig(chunk_size=4, max_num_seqs=2, num_kv_blocks=8))
    assert engine.runner.cache.k.shape[0] == cache.k.shape[0] and engine.runner.cache.k.shape[-1] == cfg.kv_layout[2]


# ---- the parts change the tokens ------------------------------------------------------------------------------


@pytest.mark.parametrize("part", [dict(n_group=1, topk_group=1), dict(correction=False)],
                         ids=["groups", "correction-bias"])
def test_each_glm_part_changes_the_tokens(part, tmp_path: Path) -> None:
    """The same weights without one GLM-4 MoE part give other tokens, in transformers and here alike: the parity
    tests hold each part to transformers, not to luck."""
    _, overrides = VARIANTS["glm4-moe-groups"]
    base = build_hf_model("glm4_moe", **overrides)
    changed = dict(part)
    if changed.pop("correction", True) is False:
        other = build_hf_model("glm4_moe", **overrides)
        with torch.no_grad():
            for name, b in other.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.zero_()
    else:
        other = build_hf_model("glm4_moe", **{**overrides, **changed})
    long = dict(GREEDY, max_new_tokens=30)
    want = other.generate(PROMPTS, **long)
    assert not torch.equal(base.generate(PROMPTS, **long), want)
    other.save_pretrained(tmp_path)
    assert torch.equal(nexttoken.generate(load_model(tmp_path), PROMPTS, **long), want)


# (Without per-layer inputs, transformers 5.24's KV-shared prefill slicing fails on its None inputs: that case is
# left out; the variants' parity holds the per-layer inputs to transformers.)
@pytest.mark.parametrize("part", [dict(num_kv_shared_layers=0)], ids=["kv-sharing"])
def test_each_gemma4_part_changes_the_tokens(part, tmp_path: Path) -> None:
    _, overrides = VARIANTS["gemma4-kv-shared-ple"]
    base = build_hf_model("gemma4", **overrides)
    other = build_hf_model("gemma4", **{**overrides, **part})
    long = dict(GREEDY, max_new_tokens=30)
    want = other.generate(PROMPTS, **long)
    assert not torch.equal(base.generate(PROMPTS, **long), want)
    other.save_pretrained(tmp_path)
    assert torch.equal(nexttoken.generate(load_model(tmp_path), PROMPTS, **long), want)


# ---- tokens ---------------------------------------------------------------------------------------------------


def test_generate_greedy_and_seeded_equal_transformers(pair) -> None:
    _, hf, model, _ = pair
    for rows in (1, 3):  # (tiny_models' every-variant suites add left-padded batches and first-step scores)
        assert torch.equal(nexttoken.generate(model, PROMPTS[:rows], **GREEDY), hf.generate(PROMPTS[:rows], **GREEDY))
        sampled = dict(max_new_tokens=20, do_sample=True, temperature=0.9, top_k=20, eos_token_id=None,
                       pad_token_id=0)
        torch.manual_seed(77)
        want = hf.generate(PROMPTS[:rows], **sampled)
        assert torch.equal(nexttoken.generate(model, PROMPTS[:rows], seed=77, **sampled), want)


def test_engine_rows_equal_transformers_and_are_batch_invariant(pair) -> None:
    """The engine's paged pool, chunked prefill past the sliding window, rows of different lengths: each row's
    tokens are transformers' for that prompt alone, and the same whether it runs alone or in the batch."""
    name, hf, model, _ = pair
    prompts = [[1, 5, 17, 33, 9, 60], [1, 40], [1, 90, 3, 3, 8, 12, 7, 7, 7, 70, 71], [1, 2, 3]]
    cfg = GenerationConfig(eos_token_id=None, top_k=None, max_new_tokens=12)
    engine = LLMEngine(model, None, EngineConfig(chunk_size=4, max_num_seqs=4))
    batched = [s.output_ids for s in engine.generate(prompts, cfg)]
    for prompt, got in zip(prompts, batched):
        want = hf.generate(torch.tensor([prompt]), **dict(GREEDY, max_new_tokens=12))[0, len(prompt):].tolist()
        assert got == want, (name, prompt)
    alone = LLMEngine(model, None, EngineConfig(chunk_size=4, max_num_seqs=1))
    assert [alone.generate([p], cfg)[0].output_ids for p in prompts[2:]] == batched[2:]


def test_the_native_step_runs_where_the_declaration_allows(pair) -> None:
    """OLMo 3 and EXAONE 4 are switches the fused native step already has, GLM-4 MoE's sigmoid group router and
    partial RoPE parts it computes, and Gemma 4's own block (per-layer shapes, KV sharing, per-layer inputs, the
    experts beside the MLP) is a layer form of its own there (fused._gemma4_layer): every one takes the step."""
    name, _, model, _ = pair
    with torch.inference_mode():
        assert (fused.rows_plan(model, model.new_cache(1, 16)) is None) == (name in MODULES_ONLY)


def test_tensor_parallelism_and_lora_refuse_gemma4_by_name(tmp_path: Path) -> None:
    from nexttoken.model.lora.adapter import read_adapter

    save_variant("gemma4-moe", tmp_path)
    with pytest.raises(nexttoken.errors.ModelLoadError, match="Gemma4ForCausalLM.*tensor_parallel_size=1"):
        nexttoken.load(tmp_path, tensor_parallel_size=2)
    with pytest.raises(nexttoken.errors.LoraError, match="Gemma4ForCausalLM"):
        read_adapter("a", tmp_path, load_model(tmp_path).config)


def test_mtp_layers_of_a_glm_checkpoint_are_left_out(tmp_path: Path) -> None:
    """GLM-4.5's checkpoints hold a multi-token-prediction layer after the last (model.layers.{n}...), which
    transformers does not load: nor do we, and the tokens are the same."""
    from safetensors.torch import load_file, save_file

    hf = save_variant("glm4-moe-groups", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    n = hf.config.num_hidden_layers
    extra = {k.replace(f"model.layers.{n - 1}.", f"model.layers.{n}."): v.clone() for k, v in tensors.items()
             if k.startswith(f"model.layers.{n - 1}.")}
    save_file({**tensors, **extra}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert torch.equal(nexttoken.generate(load_model(tmp_path), PROMPTS[:1], **GREEDY), hf.generate(PROMPTS[:1], **GREEDY))


# ---- GGUF, as llama.cpp's converter writes it ------------------------------------------------------------------


# name -> (model_type, overrides, special tokens the converter's vocabulary reader wants): OLMo 3 with one RoPE base
# (llama.cpp writes one), as an `olmo2` file with a sliding window pattern.
GGUF_CASES = {
    "glm4-moe-groups": ("glm4_moe", VARIANTS["glm4-moe-groups"][1], ["[gMASK]", "<|user|>", "<|observation|>"]),
    "exaone4-sliding-nope": ("exaone4", VARIANTS["exaone4-sliding-nope"][1], []),
    "olmo3-one-base": ("olmo3", dict(num_hidden_layers=4, sliding_window=5), []),
}


@pytest.mark.parametrize("name", sorted(GGUF_CASES))
def test_gguf_from_llama_cpps_converter_gives_the_folders_tokens(name, tmp_path: Path, shared_dir) -> None:
    """A folder (a real tokenizer: Qwen2.5's, with the special tokens the converter's GLM vocabulary needs) through
    convert_hf_to_gguf.py: the same config read back (GLM-4 MoE's groups, correction bias, shared expert, partial
    RoPE and the MTP count, block_count = layers + nextn_predict_layers; the layers' kinds), and the file's tokens
    are transformers' on the folder."""
    pytest.importorskip("gguf")
    from support.llama_cpp import convert, with_tokenizer

    arch, overrides, specials = GGUF_CASES[name]
    hf = build_hf_model(arch, **{**overrides, "vocab_size": 151680})
    folder = tmp_path / "model"
    hf.save_pretrained(folder)
    with_tokenizer(folder, shared_dir / "tokenizers" / "qwen2.5-instruct")
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    first = max(t["id"] for t in tokenizer["added_tokens"]) + 1
    tokenizer["added_tokens"] += [{"id": first + i, "content": t, "single_word": False, "lstrip": False,
                                   "rstrip": False, "normalized": False, "special": True}
                                  for i, t in enumerate(specials)]
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    llm = nexttoken.load(convert(folder, tmp_path / "model.gguf", "f32"))
    cfg, want_cfg = llm.model.config, load_model(folder).config
    assert cfg.architecture == want_cfg.architecture and cfg.layers == want_cfg.layers
    assert cfg.moe == want_cfg.moe and cfg.rope == want_cfg.rope and cfg.num_hidden_layers == want_cfg.num_hidden_layers
    ids = [5, 17, 33, 8, 61, 2, 40, 12]
    want = hf.generate(torch.tensor([ids]), **dict(GREEDY, max_new_tokens=10))[0, len(ids):].tolist()
    assert llm.generate(ids, max_new_tokens=10, ignore_eos=True).token_ids == want


# (The MoE variant's full layers get a head size of their own: the converter finds the full layers' head size only
# in a per_layer_config override, which transformers saves only where it differs.)
GEMMA4_GGUF = {"gemma4-kv-shared-ple": dict(vocab_size_per_layer_input=32000), "gemma4-moe": dict(global_head_dim=32)}


@pytest.mark.parametrize("name", sorted(GEMMA4_GGUF))
def test_gemma4_gguf_from_llama_cpps_converter_gives_the_folders_tokens(name, tmp_path: Path, shared_dir) -> None:
    """Gemma 4 (per-layer inputs, KV sharing with a double-wide MLP, keys as values, the full layers' own head
    size and KV heads, proportional RoPE; the MoE block) through convert_hf_to_gguf.py over Llama 2's tokenizer:
    the file's per-layer keys, its missing attn_v, its `rope_freqs` and its expert keys read back to the folder's
    config, the stacked experts and the router's scales to their tensors; the tokens are transformers'; its
    `gemma4` vocabulary (SentencePiece-style BPE, no prefix space) encodes as the folder's tokenizer.json does
    (which prefixes one)."""
    pytest.importorskip("gguf")
    import dataclasses

    import tokenizers
    from support.llama_cpp import convert, with_tokenizer

    _, overrides = VARIANTS[name]
    hf = build_hf_model("gemma4", **{**overrides, "vocab_size": 32000, **GEMMA4_GGUF[name]})
    folder = tmp_path / "model"
    hf.save_pretrained(folder)
    with_tokenizer(folder, shared_dir / "tokenizers" / "llama-2-chat")
    llm = nexttoken.load(convert(folder, tmp_path / "model.gguf", "f32"))
    ours, want = dataclasses.asdict(llm.model.config), dataclasses.asdict(load_model(folder).config)
    assert {k: v for k, v in ours.items() if ours[k] != want[k]}.keys() <= {"rms_norm_eps", "torch_dtype"}
    ids = [5, 17, 33, 8, 61, 2, 40, 12]
    expected = hf.generate(torch.tensor([ids]), **dict(GREEDY, max_new_tokens=10))[0, len(ids):].tolist()
    assert llm.generate(ids, max_new_tokens=10, ignore_eos=True).token_ids == expected
    reference = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    for text in ["Hello world, how are you?", "Two\n\nlines\nend", "naïve café 日本語 🙂", "  spaces   inside"]:
        assert llm.tokenizer.encode(" " + text) == reference.encode(text).ids


def test_a_quantized_gemma4_gguf_keeps_its_blocks_and_gives_its_dequantized_tokens(tmp_path: Path, shared_dir) -> None:
    """Gemma 4 with per-layer inputs through the converter at q8_0: the attention, MLP and per-layer input matrices,
    the token table and the (vocab, layers x P) per-layer table stay in their blocks (GGUFLinear / GGUFEmbedding:
    a quantized E2B / E4B file would not fit in memory as floats), and the tokens are those of the file's own
    values dequantized to float32, with the fused native step (which reads the blocks) and with the modules."""
    pytest.importorskip("gguf")
    from nexttoken.model.quant.ggml import GGUFEmbedding, GGUFLinear, native_blocks
    from support.llama_cpp import convert, with_tokenizer

    if not native_blocks():
        pytest.skip("the GGUF block kernels need AVX-512 VNNI (the file then loads dequantized)")
    _, overrides = VARIANTS["gemma4-kv-shared-ple"]
    # widths that are multiples of 32 (q8_0's block) everywhere the blocks are kept
    hf = build_hf_model("gemma4", **{**overrides, "vocab_size": 32000, "vocab_size_per_layer_input": 32000,
                                     "intermediate_size": 64})
    hf.save_pretrained(tmp_path / "model")
    with_tokenizer(tmp_path / "model", shared_dir / "tokenizers" / "llama-2-chat")
    path = convert(tmp_path / "model", tmp_path / "model.gguf", "q8_0")
    ids = [5, 17, 33, 8, 61, 2, 40, 12]
    exact = nexttoken.load(path, dequantize=True).generate(ids, max_new_tokens=10, ignore_eos=True).token_ids
    llm = nexttoken.load(path)
    model = llm.model
    assert model.quantization == "gguf" and isinstance(model.embed, GGUFEmbedding)
    assert isinstance(model.per_layer_embed, GGUFEmbedding) and isinstance(model.per_layer_projection, GGUFLinear)
    for block in model.layers:
        assert isinstance(block.attention.wqkv, GGUFLinear) and isinstance(block.attention.wo, GGUFLinear)
        assert isinstance(block.mlp.w13, GGUFLinear) and isinstance(block.mlp.w2, GGUFLinear)
        assert isinstance(block.input_gate, GGUFLinear) and isinstance(block.input_projection, GGUFLinear)
    with torch.inference_mode():  # the fused native step reads the kept blocks as they are
        assert fused.rows_plan(model, model.new_cache(1, 16)) is not None
    assert llm.generate(ids, max_new_tokens=10, ignore_eos=True).token_ids == exact
    with fused.disabled(model):
        assert llm.generate(ids, max_new_tokens=10, ignore_eos=True).token_ids == exact


def test_a_quantized_gemma4_moe_gguf_keeps_its_experts_in_blocks(tmp_path: Path, shared_dir) -> None:
    """Gemma 4's MoE block through the converter at q8_0: the stacked experts (`ffn_gate_up_exps` (E, 2I, C),
    `ffn_down_exps` (E, C, I)) stay in their blocks, one GGUFLinear per expert (a quantized 26B-A4B file would not
    fit in memory as floats), and one decode step's logits, fused native step or modules, are within float32
    rounding of the file's own values dequantized to float32; the greedy tokens are theirs."""
    pytest.importorskip("gguf")
    from nexttoken.model.quant.ggml import GGUFLinear, native_blocks
    from support.fused import step_logits
    from support.llama_cpp import convert, with_tokenizer

    if not native_blocks():
        pytest.skip("the GGUF block kernels need AVX-512 VNNI (the file then loads dequantized)")
    _, overrides = VARIANTS["gemma4-moe"]
    hf = build_hf_model("gemma4", **{**overrides, "vocab_size": 32000, "global_head_dim": 32, "intermediate_size": 64})
    hf.save_pretrained(tmp_path / "model")
    with_tokenizer(tmp_path / "model", shared_dir / "tokenizers" / "llama-2-chat")
    path = convert(tmp_path / "model", tmp_path / "model.gguf", "q8_0")
    exact = nexttoken.load(path, dequantize=True)
    llm = nexttoken.load(path)
    model = llm.model
    for block in model.layers:
        experts = block.experts
        assert experts.gate_up is None and experts.down is None
        assert len(experts.gate_up_layers) == len(experts.down_layers) == 4
        assert all(isinstance(m, GGUFLinear) for m in [*experts.gate_up_layers, *experts.down_layers])
    with torch.inference_mode():
        assert fused.rows_plan(model, model.new_cache(1, 16)) is not None
    with fused.disabled():
        want, modules = step_logits(exact.model), step_logits(model)
    torch.testing.assert_close(step_logits(model), want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(modules, want, rtol=1e-5, atol=1e-4)
    ids = [5, 17, 33, 8, 61, 2, 40, 12]
    assert (llm.generate(ids, max_new_tokens=10, ignore_eos=True).token_ids
            == exact.generate(ids, max_new_tokens=10, ignore_eos=True).token_ids)
