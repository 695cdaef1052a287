"""Gemma 2 / 3, Phi-3 and the mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE) beyond the shared parity tests
(test_generation_parity.py, test_fused.py run every variant): the engine, bfloat16, int8 and sharded checkpoints,
each against transformers on the same random weights."""

from __future__ import annotations

import json

import pytest
import torch

from nexttoken.bench.report import experts_read, linear_params
from nexttoken.bench.shapes import config_for
from nexttoken.config import SUPPORTED_ARCHITECTURES, ModelConfig
from nexttoken.engine import EngineConfig, LLMEngine
from nexttoken.errors import ModelLoadError
from nexttoken.generation import generate
from nexttoken.generation.config import GenerationConfig
from nexttoken.model import kernels, load_model
from nexttoken.model.quant.int8 import Int8Linear, quantize_rows
from nexttoken.model.linear import KeptLinear, Linear
from nexttoken.model.moe import MoE
from nexttoken.model.quant import quantize_int8, tiles
from support.tiny_models import PROMPTS, left_padded, save_variant

FAMILIES = ["gemma2-softcap-sliding", "gemma3-local-global-rope", "mixtral-moe", "qwen2-moe-shared",
            "qwen3-moe-norm-topk", "phi3-longrope-long", "phi3-sliding-tied"]
MOE = [v for v in FAMILIES if "moe" in v]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf = save_variant(request.param, directory)
    return request.param, directory, hf


def test_engine_greedy_equals_transformers_per_prompt(pair) -> None:
    """Every row of an engine batch (chunked prefill, rows of other lengths beside it) equals transformers'
    generate on that prompt alone; the sequences run past the sliding windows."""
    _, directory, hf = pair
    engine = LLMEngine(load_model(directory), None, EngineConfig(chunk_size=8, max_num_seqs=4,
                                                                 max_num_batched_tokens=24))
    prompts = [[1, 5, 9, 22], [1] + list(range(10, 30)), [1, 7, 3], [1, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59]]
    seqs = engine.generate(prompts, GenerationConfig(eos_token_id=None, top_k=None, max_new_tokens=12))
    for prompt, seq in zip(prompts, seqs):
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(prompt):].tolist()
        assert seq.output_ids == expected, prompt


def test_bfloat16_logits_close_to_transformers_in_bfloat16(pair) -> None:
    """Loaded as bfloat16: first-step logits of a left-padded batch are as close to transformers' in bfloat16 as
    bf16 rounding allows (Gemma's (1 + w) norm in float32 and its embedding scale rounded to bf16, as transformers
    does): within 2% of the logit range, or (where the model amplifies rounding, e.g. LongRoPE's attention factor)
    no further than transformers' own bf16 logits are from float32. (Greedy tokens over many steps are compared in float32: in bf16 two implementations part at the
    first near-tie.)"""
    _, directory, hf = pair
    ids, mask = left_padded(PROMPTS)
    first = dict(max_new_tokens=1, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    exact = generate(load_model(directory), ids, attention_mask=mask, **first).logits[0]  # float32, == transformers
    ours = load_model(directory, dtype="bfloat16")
    hf = hf.to(torch.bfloat16)
    want = hf.generate(input_ids=ids, attention_mask=mask, **first).logits[0].float()
    have = generate(ours, ids, attention_mask=mask, **first).logits[0].float()
    hf.float()
    theirs_off = (want - exact).abs().max().item()
    assert (have - want).abs().max().item() <= max(0.02 * exact.abs().max().item(), theirs_off)
    out = generate(ours, ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert out.shape == (3, ids.shape[1] + 12)


def test_int8_equals_the_float_model_on_its_dequantized_weights(pair) -> None:
    """int8 weights: every expert (and dense) projection and the embedding are quantized, the router stays in the
    model's dtype; the logits equal (within float rounding) the float model's with each weight replaced by its
    dequantized value (the same routing, by construction), and the engine generates with it."""
    name, directory, _ = pair
    reference = load_model(directory)
    with torch.no_grad():
        for m in reference.modules():
            if type(m) is Linear:  # lm_head shares the embedding's tensor where tied
                q, scale = quantize_rows(m.weight)
                m.weight.copy_(q.float() * scale[:, None])
        if not reference.config.tie_word_embeddings:
            q, scale = quantize_rows(reference.embed.weight)
            reference.embed.weight.copy_(q.float() * scale[:, None])
    model = quantize_int8(load_model(directory))
    assert not any(type(m) is Linear for m in model.modules())
    if name in MOE:
        moe = next(m for m in model.modules() if isinstance(m, MoE))
        assert all(isinstance(e.w13, Int8Linear) and isinstance(e.w2, Int8Linear) for e in moe.experts)
        assert type(moe.gate) is KeptLinear and moe.gate.weight.dtype == torch.float32  # never quantized
    ids, mask = left_padded(PROMPTS)
    first = dict(max_new_tokens=1, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    want = generate(reference, ids, attention_mask=mask, **first).logits[0]
    with tiles.precision("float32"):  # the prompt's products exact (by default they run on bf16 GEMMs)
        have = generate(model, ids, attention_mask=mask, **first).logits[0]
    torch.testing.assert_close(have, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    float_model = generate(load_model(directory), ids, attention_mask=mask, **first).logits[0]
    assert not torch.allclose(have, float_model, atol=1e-3)  # quantized for real
    engine = LLMEngine(model, None, EngineConfig(chunk_size=8, max_num_seqs=4))
    out = engine.generate(PROMPTS, GenerationConfig(eos_token_id=None, top_k=None, max_new_tokens=8))
    assert all(len(s.output_ids) == 8 for s in out)


@pytest.mark.skipif(not kernels.available(), reason="native kernel unavailable")
@pytest.mark.parametrize("variant", MOE)
def test_int8_experts_kernel_and_torch_fallback_agree(variant, tmp_path, monkeypatch) -> None:
    save_variant(variant, tmp_path)
    model = quantize_int8(load_model(tmp_path))
    ids = torch.tensor([[1, 5, 17, 33, 9], [1, 40, 41, 42, 43]])
    kwargs = dict(max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
    fast = generate(model, ids, **kwargs)
    monkeypatch.setattr(kernels, "usable", lambda x, w: False)  # torch's _weight_int8pack_mm instead
    assert torch.equal(generate(model, ids, **kwargs), fast)


@pytest.mark.parametrize("variant", ["gemma3-local-global-rope", "qwen2-moe-shared"])
def test_sharded_checkpoint_from_save_pretrained(variant, tmp_path) -> None:
    """transformers' own sharding (save_pretrained(max_shard_size=...)): several files and an index, loaded to the
    same weights and tokens as the single file."""
    hf = save_variant(variant, tmp_path / "single")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert not (tmp_path / "sharded" / "model.safetensors").exists()
    single, sharded = load_model(tmp_path / "single"), load_model(tmp_path / "sharded")
    for (name, a), (_, b) in zip(single.state_dict().items(), sharded.state_dict().items()):
        assert torch.equal(a, b), name
    ids, mask = left_padded(PROMPTS)
    kwargs = dict(max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(generate(sharded, ids, attention_mask=mask, **kwargs),
                       hf.generate(input_ids=ids, attention_mask=mask, **kwargs))


def test_moe_runs_only_the_chosen_experts(tmp_path) -> None:
    """Per token only its top k experts run: an expert no token chose is never called."""
    save_variant("qwen3-moe-norm-topk", tmp_path)
    model = load_model(tmp_path)
    calls: dict[int, int] = {}
    moe = model.layers[0].mlp
    for e, expert in enumerate(moe.experts):
        expert.register_forward_hook(lambda m, i, o, e=e: calls.__setitem__(e, calls.get(e, 0) + i[0].shape[0]))
    x = torch.randn(1, 3, model.config.hidden_size)  # 3 tokens x top 3 of 8 experts
    _, chosen = moe.route(x.reshape(-1, x.shape[-1]))
    moe(x)
    assert set(calls) == set(chosen.unique().tolist())
    assert sum(calls.values()) == chosen.numel() == 3 * 3


def test_unsupported_architecture_names_every_supported_one() -> None:
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel") as err:
        ModelConfig.from_dict({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    assert all(name in str(err.value) for name in SUPPORTED_ARCHITECTURES)
    assert {"Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM",
            "Qwen3MoeForCausalLM"} <= set(SUPPORTED_ARCHITECTURES)


BASE_FIELDS = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2)


@pytest.mark.parametrize("arch, fields, message", [
    ("Qwen3MoeForCausalLM", dict(num_experts=4, num_experts_per_tok=5, moe_intermediate_size=8), "num_experts_per_tok"),
    ("MixtralForCausalLM", dict(num_experts_per_tok=2), "num_experts_per_tok"),
    ("Qwen2MoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8),
     "shared_expert_intermediate_size"),
    ("Phi3ForCausalLM", dict(original_max_position_embeddings=16, rope_scaling=dict(
        type="longrope", short_factor=[1.0] * 3, long_factor=[1.0] * 8)), "short_factor must be 8"),
    ("Gemma3ForCausalLM", dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    ("Gemma2ForCausalLM", dict(hidden_activation="relu"), "'relu'"),
    ("Gemma2ForCausalLM", dict(final_logit_softcapping=-1.0), "final_logit_softcapping"),
    ("Gemma2ForCausalLM", dict(sliding_window=8, layer_types=["full_attention"]), "layer_types has 1 entries"),
])
def test_bad_family_config_is_a_clear_error(arch, fields, message) -> None:
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.from_dict({"architectures": [arch], **BASE_FIELDS, **fields})


def test_bench_moe_shape_is_a_qwen3_moe() -> None:
    """The bench's MoE shape loads as Qwen3-MoE, and the report counts what a step reads: k experts for one token,
    more for a batch (uniform routing), all of them for memory."""
    cfg = ModelConfig.from_dict(config_for("moe", "float32"))
    assert cfg.architecture == "Qwen3MoeForCausalLM" and cfg.qk_norm == "head"
    moe = cfg.moe
    assert moe is not None and moe.top_k < moe.num_experts and all(moe.sparse_layers)
    assert experts_read(cfg, 1) == pytest.approx(moe.top_k)
    assert moe.top_k < experts_read(cfg, 4) < min(4 * moe.top_k, moe.num_experts)
    every, _ = linear_params(cfg)
    active, _ = linear_params(cfg, moe.top_k)
    assert active < every / 3


@pytest.mark.parametrize("arch, tokenizer, overrides", [
    ("qwen3_moe", "qwen2.5-instruct", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                           norm_topk_prob=True)),
    ("gemma2", "llama-2-chat", dict(head_dim=8, query_pre_attn_scalar=8)),
])
def test_cli_generate_equals_transformers(arch, tokenizer, overrides, shared_dir, tmp_path) -> None:
    """The command line, run as a user runs it, on a family's model over its real tokenizer: the greedy token ids
    it prints equal transformers' greedy continuation of the same prompt ids."""
    import subprocess
    import sys

    from support.tiny_models import build_chat_model

    folder = build_chat_model(tmp_path / arch, shared_dir / "tokenizers" / tokenizer, arch, **overrides)
    r = subprocess.run([sys.executable, "-m", "nexttoken.cli", "generate", "The weather today is", "--model",
                        str(folder), "--json", "--temperature", "0", "--max-new-tokens", "10"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(hf).__name__ == json.loads((folder / "config.json").read_text())["architectures"][0]
    ids = torch.tensor([result["prompt_token_ids"]])
    expected = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=len(result["token_ids"]),
                           do_sample=False, eos_token_id=None, pad_token_id=0)[0, ids.shape[1]:].tolist()
    assert result["token_ids"] == expected and len(expected) > 0


def test_hub_style_gemma_configs_without_layer_types() -> None:
    """Configs as the Hub has them (before transformers wrote layer_types): Gemma 2 alternates sliding and global
    layers from the first; Gemma 3 has sliding_window_pattern (every 6th layer global), rope_local_base_freq for the
    sliding layers and rope_scaling for the global ones."""
    gemma2 = ModelConfig.from_dict({"architectures": ["Gemma2ForCausalLM"], **BASE_FIELDS, "num_hidden_layers": 4,
                                    "head_dim": 16, "sliding_window": 4096, "query_pre_attn_scalar": 16,
                                    "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": 30.0,
                                    "attn_logit_softcapping": 50.0})
    assert gemma2.sliding_layers == (True, False, True, False) and gemma2.attn_logit_softcapping == 50.0
    gemma3 = ModelConfig.from_dict({"architectures": ["Gemma3ForCausalLM"], **BASE_FIELDS, "num_hidden_layers": 7,
                                    "head_dim": 16, "sliding_window": 512, "sliding_window_pattern": 6,
                                    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
                                    "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                                    "attn_logit_softcapping": None, "final_logit_softcapping": None})
    assert gemma3.sliding_layers == (True,) * 5 + (False, True)
    assert (gemma3.rope.theta, gemma3.rope.type, gemma3.rope.factor) == (1_000_000.0, "linear", 8.0)
    assert (gemma3.rope_local.theta, gemma3.rope_local.type) == (10_000.0, "default")
    assert gemma3.qk_norm == "head" and gemma3.attn_logit_softcapping is None


def test_server_serves_a_moe_model_as_transformers_generates(shared_dir, tmp_path) -> None:
    """`nexttoken serve` on a Qwen3-MoE model over Qwen2.5's real tokenizer, driven by the openai client: the
    greedy completion is transformers' greedy continuation of the same prompt ids."""
    openai = pytest.importorskip("openai")
    from support.server import start_server, stop_server
    from support.tiny_models import build_chat_model
    from transformers import AutoModelForCausalLM

    from nexttoken.text.tokenizer import Tokenizer

    folder = build_chat_model(tmp_path / "moe", shared_dir / "tokenizers" / "qwen2.5-instruct", "qwen3_moe",
                              num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
    proc, url = start_server(folder)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        r = client.completions.create(model=model, prompt="The weather today is", max_tokens=8, temperature=0)
    finally:
        stop_server(proc)
    tok = Tokenizer.from_dir(folder)
    ids = torch.tensor([tok.encode("The weather today is")])
    assert r.usage.prompt_tokens == ids.shape[1] and r.usage.completion_tokens > 0
    hf = AutoModelForCausalLM.from_pretrained(folder).eval()
    expected = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=r.usage.completion_tokens,
                           do_sample=False, eos_token_id=None, pad_token_id=0)[0].tolist()
    prompt_text = tok.decode(ids[0].tolist(), skip_special_tokens=True)
    assert prompt_text + r.choices[0].text == tok.decode(expected, skip_special_tokens=True)
