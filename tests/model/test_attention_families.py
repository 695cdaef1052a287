"""The attention families of 2026 added through their declarations (issue 42): GLM-4.5 / 4.6 MoE
(families/glm.py), OLMo 3 (families/olmo3.py), EXAONE 4 (families/exaone.py). Their configs read as transformers
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
from support.tiny_models import VARIANTS, build_hf_model, save_variant

NAMES = ["glm4-moe-groups", "olmo3-sliding", "exaone4-sliding-nope"]
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


# ---- the parts change the tokens ------------------------------------------------------------------------------


@pytest.mark.parametrize("part", [dict(n_group=1, topk_group=1), dict(routed_scaling_factor=1.0),
                                  dict(partial_rotary_factor=1.0), dict(correction=False)],
                         ids=["groups", "scaling", "partial-rope", "correction-bias"])
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


# ---- tokens ---------------------------------------------------------------------------------------------------


def test_generate_greedy_and_seeded_equal_transformers(pair) -> None:
    _, hf, model, _ = pair
    for rows in (1, 3):
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
    """OLMo 3 and EXAONE 4 are switches the fused native step already has; GLM-4 MoE's declaration keeps the
    modules (its sigmoid router and partial RoPE are not native): the step refuses it, and the tokens above are
    the modules'."""
    name, _, model, _ = pair
    cache = model.new_cache(1, 16)
    assert (fused.rows_plan(model, cache) is None) == (name == "glm4-moe-groups")


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


def test_glm4_moe_gguf_from_llama_cpps_converter_gives_the_folders_tokens(tmp_path: Path, shared_dir) -> None:
    """A GLM-4 MoE folder (a real tokenizer: Qwen2.5's, with the special tokens the converter's GLM vocabulary
    needs) through convert_hf_to_gguf.py: groups, correction bias, shared expert, partial RoPE and the MTP count
    (block_count = layers + nextn_predict_layers) read back; the file's tokens are the folder's."""
    pytest.importorskip("gguf")
    from support.llama_cpp import convert, with_tokenizer

    _, overrides = VARIANTS["glm4-moe-groups"]
    hf = build_hf_model("glm4_moe", **{**overrides, "vocab_size": 151680})
    folder = tmp_path / "glm"
    hf.save_pretrained(folder)
    with_tokenizer(folder, shared_dir / "tokenizers" / "qwen2.5-instruct")
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    first = max(t["id"] for t in tokenizer["added_tokens"]) + 1
    tokenizer["added_tokens"] += [{"id": first + i, "content": t, "single_word": False, "lstrip": False,
                                   "rstrip": False, "normalized": False, "special": True}
                                  for i, t in enumerate(["[gMASK]", "<|user|>", "<|observation|>"])]
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    path = convert(folder, tmp_path / "glm.gguf", "f32")
    llm = nexttoken.load(path)
    cfg = llm.model.config
    assert cfg.num_hidden_layers == 3 and cfg.moe == load_model(folder).config.moe
    assert cfg.rope.partial_rotary_factor == 0.5
    ids = [5, 17, 33, 8, 61, 2, 40, 12]
    want = hf.generate(torch.tensor([ids]), **dict(GREEDY, max_new_tokens=10))[0, len(ids):].tolist()
    assert llm.generate(ids, max_new_tokens=10, ignore_eos=True).token_ids == want
