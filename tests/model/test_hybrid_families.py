"""Issue 41's other hybrid families against transformers 5.24 on the same random weights: Granite 4.0-H with experts,
LFM2-MoE, Qwen3.5-MoE, Qwen3-Next (delta-rule projections grouped per key head, MoE with a gated shared expert),
Falcon-H1 (attention and Mamba2 side by side in each layer, µP multipliers) and Nemotron-H (each layer one of Mamba2,
attention, squared-ReLU MLP). Per family: config reading, every position's logits, chunked prefill with chunk sizes
1, 7 and 64 leaving the state of one pass, greedy and seeded tokens through `nexttoken.generate`, and greedy tokens
through the engine (a mixed batch, the long prompt prefilled in chunks of 7 while the other decodes) and
`nexttoken.load`. (LFM2, Qwen3.5, dense Granite 4.0-H and Mamba2: test_hybrid_models.py.)"""

from __future__ import annotations

import pytest
import torch

import nexttoken
from nexttoken.config import ModelConfig
from nexttoken.engine import EngineConfig, LLMEngine
from nexttoken.errors import ModelLoadError
from nexttoken.families import CONVOLUTION, FULL, LINEAR_ATTENTION, NOPE, STATE_SPACE
from nexttoken.generation.config import GenerationConfig
from nexttoken.model import ForwardBatch, load_model
from nexttoken.model.quant.ggml import native_blocks
from support.tiny_models import HYBRID_FAMILIES, save_variant

LONG = [1] + [(7 * i + 3) % 95 + 1 for i in range(69)]  # > 64 tokens: two chunks of the delta rule's parallel form
SHORT = [1, 5, 17, 33, 9, 60, 7, 7, 21]
PROMPTS = torch.tensor([[1, 5, 17, 33, 9, 60], [1, 40, 41, 42, 43, 44], [1, 90, 3, 3, 8, 12]])
NEW = 8
GREEDY = dict(max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
SAMPLED = dict(max_new_tokens=NEW, do_sample=True, temperature=0.9, top_k=20, eos_token_id=None, pad_token_id=0)


@pytest.fixture(scope="module", params=sorted(HYBRID_FAMILIES))
def case(request, tmp_path_factory):
    """(ours, folder, transformers' answers: logits of LONG, greedy continuations of SHORT and LONG, seeded samples
    of PROMPTS; and ours of LONG in one pass: its logits and the cache it leaves)."""
    folder = tmp_path_factory.mktemp(request.param)
    hf = save_variant(request.param, folder)
    with torch.no_grad():
        logits = hf(torch.tensor([LONG])).logits[0]
    greedy = [hf.generate(torch.tensor([p]), **GREEDY)[0, len(p):].tolist() for p in (SHORT, LONG)]
    torch.manual_seed(77)
    sampled = hf.generate(PROMPTS, **SAMPLED)
    model = load_model(folder)
    return model, folder, {"logits": logits, "greedy": greedy, "sampled": sampled,
                           "one_pass": _prefill(model, LONG, len(LONG))}


def _prefill(model, ids: list[int], chunk: int) -> tuple[torch.Tensor, object]:
    """(T, V) logits of every position of `ids` prefilled in chunks of `chunk`, and the cache left behind."""
    cache = model.new_cache(1, len(ids) + 1)
    valid = torch.ones(1, len(ids) + 1, dtype=torch.bool)
    out = []
    with torch.no_grad():
        for start in range(0, len(ids), chunk):
            end = min(start + chunk, len(ids))
            cols = torch.arange(start, end)[None]
            batch = ForwardBatch.build(cols, cols, valid, end, write_start=start, last_only=False)
            out.append(model(torch.tensor([ids[start:end]]), batch, cache)[0])
    return torch.cat(out), cache


def test_configs_read_as_transformers_builds_them() -> None:
    """transformers' own configs of each family: the layer kinds, the experts, the multipliers, the refusals."""
    import transformers

    granite = ModelConfig.from_dict(transformers.GraniteMoeHybridConfig(num_hidden_layers=2).to_dict())
    assert granite.moe.num_experts == 8 and granite.moe.shared_intermediate_size == 1024 and not granite.moe.shared_gate
    lfm = ModelConfig.from_dict(transformers.Lfm2MoeConfig(num_hidden_layers=4, layer_types=[
        "conv", "full_attention", "conv", "conv"]).to_dict())
    assert lfm.layers == (CONVOLUTION, FULL, CONVOLUTION, CONVOLUTION) and lfm.intermediate_size == 7168
    assert lfm.moe.sparse_layers == (False, False, True, True) and lfm.moe.correction_bias  # num_dense_layers 2
    qwen = ModelConfig.from_dict(transformers.Qwen3_5MoeTextConfig(num_hidden_layers=4).to_dict())
    assert qwen.layers == (LINEAR_ATTENTION,) * 3 + (FULL,) and qwen.moe.shared_gate and all(qwen.moe.sparse_layers)
    nxt = ModelConfig.from_dict(transformers.Qwen3NextConfig(num_hidden_layers=4).to_dict())
    assert nxt.recurrent.linear_grouped_by_key_head and nxt.moe.num_experts == 512 and nxt.norm_plus_one
    falcon = ModelConfig.from_dict(transformers.FalconH1Config(num_hidden_layers=3, mamba_d_ssm=None, mamba_n_heads=64,
                                                               mamba_d_head=128).to_dict())
    assert falcon.num_hidden_layers == 6 and falcon.layers == (STATE_SPACE, FULL) * 3  # two of ours per layer
    nemotron = ModelConfig.from_dict(transformers.NemotronHConfig(hybrid_override_pattern="M-M*-M").to_dict())
    assert nemotron.layers == (STATE_SPACE, STATE_SPACE, NOPE, STATE_SPACE) and nemotron.layer_pattern == "M-M*-M"
    nemotron3 = ModelConfig.from_dict(transformers.NemotronHConfig(hybrid_override_pattern="ME*E").to_dict())
    assert nemotron3.layers == (STATE_SPACE, NOPE) and nemotron3.moe.sparse_layers == (True, True)
    assert nemotron3.moe.scoring == "sigmoid" and nemotron3.moe.correction_bias and not nemotron3.moe.shared_gate
    with pytest.raises(ModelLoadError, match="moe_latent_size=32"):
        ModelConfig.from_dict(transformers.NemotronHConfig(hybrid_override_pattern="ME*E", moe_latent_size=32).to_dict())
    with pytest.raises(ModelLoadError, match="must follow a Mamba2 or attention layer"):
        ModelConfig.from_dict(transformers.NemotronHConfig(hybrid_override_pattern="M-E*").to_dict())


def test_logits_equal_transformers(case) -> None:
    """Every position of a 70-token prompt (the parallel forms over several chunks) within float32 rounding."""
    _, _, want = case
    got, _ = want["one_pass"]
    assert torch.allclose(got, want["logits"], atol=1e-4, rtol=1e-4), (got - want["logits"]).abs().max()


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_leaves_the_state_of_one_pass(case, chunk: int) -> None:
    """Chunks of 1 (the one-step recurrence), 7 or 64 tokens leave the recurrent state and K/V of one pass, within
    float tolerance, and the same logits."""
    model, _, want = case
    whole, ref = want["one_pass"]
    got, cache = _prefill(model, LONG, chunk)
    assert torch.allclose(got, whole, atol=1e-4, rtol=1e-4)
    assert ref.states.tensors.keys() == cache.states.tensors.keys() and ref.states.tensors
    for layer, tensors in ref.states.tensors.items():
        for a, b in zip(tensors, cache.states.tensors[layer]):
            assert torch.allclose(a, b, atol=1e-5, rtol=1e-4), (layer, (a - b).abs().max())
    assert torch.allclose(ref.k, cache.k, atol=1e-4, rtol=1e-4)


def test_generate_greedy_and_seeded_equal_transformers(case) -> None:
    model, _, want = case
    assert nexttoken.generate(model, torch.tensor([SHORT]), **GREEDY)[0, len(SHORT):].tolist() == want["greedy"][0]
    assert torch.equal(nexttoken.generate(model, PROMPTS, seed=77, **SAMPLED), want["sampled"])


def test_engine_and_load_greedy_equal_transformers(case) -> None:
    """The engine on a mixed batch (the 70-token prompt prefilled in chunks of 7 while the short one decodes), and
    `nexttoken.load` of the folder."""
    model, folder, want = case
    engine = LLMEngine(model, None, EngineConfig(max_num_seqs=2, chunk_size=7, max_num_batched_tokens=16))
    assert len(engine.runner.states.tensors) == sum(
        not model.config.layer(i).keeps_kv for i in range(model.config.num_hidden_layers))
    seqs = engine.generate([SHORT, LONG], GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=None))
    assert [s.output_ids for s in seqs] == want["greedy"]
    assert nexttoken.load(folder).generate(SHORT, max_new_tokens=NEW, ignore_eos=True).token_ids == want["greedy"][0]


def test_preempted_requests_give_their_tokens(case) -> None:
    """A pool too small for both: one is preempted, recomputed (its state rebuilt from zero) and gives the tokens
    transformers gives."""
    model, _, want = case
    engine = LLMEngine(model, None, EngineConfig(max_num_seqs=2, chunk_size=16, block_size=4, num_kv_blocks=22))
    seqs = engine.generate([SHORT, LONG], GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=None))
    assert engine.scheduler.num_preemptions > 0
    assert [s.output_ids for s in seqs] == want["greedy"]


# ---- GGUF, as llama.cpp's converter writes it ------------------------------------------------------------------

# Real-tokenizer variants for llama.cpp's converter: vocab_size covering Qwen2.5's tokenizer, a narrower model. As
# the released checkpoints: Granite 4.0-H without RoPE; LFM2-MoE's routed_scaling_factor 1 (the converter writes none).
GGUF_VARIANTS = {
    "granite4h-moe": dict(vocab_size=151680, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                          mamba_d_head=16, position_embedding_type=None),
    "lfm2-moe": dict(vocab_size=151680, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                     routed_scaling_factor=1.0),
    # issue 41's GGUF files of the other four: Qwen3-Next with every layer sparse (the converter cannot write its
    # dense MLP layers: "Can not map tensor 'model.layers.0.mlp.down_proj.weight'"), as the released 80B-A3B
    "qwen3_5-moe": dict(vocab_size=151680, hidden_size=32, num_attention_heads=2, num_key_value_heads=1),
    "qwen3_next": dict(vocab_size=151680, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                       mlp_only_layers=[]),
    "falcon_h1": dict(vocab_size=151680, hidden_size=32, num_attention_heads=2, num_key_value_heads=1),
    "nemotron_h": dict(vocab_size=151680, hidden_size=32, num_attention_heads=2, num_key_value_heads=1),
}
# the converter's own flags per variant: the Qwen3.5 / Qwen3-Next converters refuse a model without MTP layers
# unless told to leave them out
GGUF_FLAGS = {"qwen3_5-moe": ("--no-mtp",), "qwen3_next": ("--no-mtp",)}


# f32 files of both (the folder's tokens); a Q8_0 file of one (its own dequantized run's): each converter run costs
@pytest.mark.parametrize(("variant", "outtype"), [
    ("granite4h-moe", "f32"), ("lfm2-moe", "f32"), ("lfm2-moe", "q8_0"), ("qwen3_5-moe", "f32"), ("qwen3_5-moe", "q8_0"),
    ("qwen3_next", "f32"), ("falcon_h1", "f32"), ("nemotron_h", "f32"), ("nemotron_h", "q8_0")])
def test_gguf_from_llama_cpps_converter(variant: str, outtype: str, tmp_path, shared_dir) -> None:
    """A tiny Granite 4.0-H with experts / LFM2-MoE over Qwen2.5's real tokenizer, converted by llama.cpp's
    convert_hf_to_gguf.py: the stacked experts (ffn_*_exps), the shared expert (ffn_*_shexp), the router, LFM2-MoE's
    expert bias (exp_probs_b) and dense first layers read back to the folder's model. An f32 file gives the folder's
    tokens; a Q8_0 file, loaded by default, gives its own dequantized run's.
    The other four (issue 41's GGUF files): Qwen3.5-MoE (`qwen35moe`: Qwen3.5's tiled value heads and shifted norms
    with the experts), Qwen3-Next (`qwen3next`: in_proj_qkvz written as attn_qkv + attn_gate in Qwen3.5's order, read
    back grouped per key head), Falcon-H1 (`falcon-h1`: every µP multiplier multiplied into the weights, none
    written) and Nemotron-H (written as `nemotron_h_moe`, since transformers 5's config carries MoE defaults: the
    pattern read from each block's tensors)."""
    import json

    from support.llama_cpp import convert, with_tokenizer
    from support.tiny_models import VARIANTS, build_hf_model

    arch, overrides = VARIANTS[variant]
    hf = build_hf_model(arch, **{**overrides, **GGUF_VARIANTS[variant]})
    hf.save_pretrained(tmp_path)
    if arch == "granitemoehybrid":  # the converter reads the released checkpoints' layer names, not transformers 5's
        raw = json.loads((tmp_path / "config.json").read_text())
        raw["layer_types"] = ["mamba" if t == "linear_attention" else "attention" for t in raw["layer_types"]]
        (tmp_path / "config.json").write_text(json.dumps(raw))
    with_tokenizer(tmp_path, shared_dir / "tokenizers" / "qwen2.5-instruct")
    path = convert(tmp_path, tmp_path / f"{variant}.gguf", outtype, GGUF_FLAGS.get(variant, ()))
    ids = [5, 17, 33, 8, 61, 2, 40, 12]
    exact = nexttoken.load(path, dequantize=True)
    folder = load_model(tmp_path).config
    assert exact.model.config.moe == folder.moe and exact.model.config.layers == folder.layers
    assert exact.model.config.layer_pattern == folder.layer_pattern
    got = exact.generate(ids, max_new_tokens=NEW, ignore_eos=True).token_ids
    if outtype == "f32":
        assert got == hf.generate(torch.tensor([ids]), **GREEDY)[0, len(ids):].tolist()
    default = nexttoken.load(path)
    assert default.generate(ids, max_new_tokens=NEW, ignore_eos=True).token_ids == got
    if outtype == "q8_0" and native_blocks():  # the attention and the experts kept in their Q8_0 blocks
        from nexttoken.model.layers import Attention
        from nexttoken.model.quant.ggml import GGUFLinear

        assert all(isinstance(b.attention.wqkv, GGUFLinear) and isinstance(b.attention.wo, GGUFLinear)
                   for b in default.model.layers if isinstance(b.attention, Attention))
        if variant == "nemotron_h":  # a network of its own (GGUF_PACKED): its relu^2 MLPs' blocks kept too
            assert all(isinstance(b.mlp.w1, GGUFLinear) for b in default.model.layers if b.mlp is not None)
        else:
            assert any(isinstance(e.w13, GGUFLinear) for b in default.model.layers if hasattr(b.mlp, "experts")
                       for e in b.mlp.experts)


def test_a_vision_language_qwen3_5_moe_checkpoint_loads_its_text_model(tmp_path) -> None:
    """Qwen3.5-MoE's released checkpoints are Qwen3_5MoeForConditionalGeneration: the text model from `text_config`
    and `model.language_model.*`, the vision tower left out; its text tokens are transformers' own model's."""
    import transformers
    from support.tiny_models import BASE, VARIANTS

    _, text = VARIANTS["qwen3_5-moe"]
    cfg = transformers.Qwen3_5MoeConfig(text_config={**BASE, **text}, vision_config=dict(
        depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64))
    torch.manual_seed(0)
    hf = transformers.Qwen3_5MoeForConditionalGeneration(cfg).eval()
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path)
    assert model.config.architecture == "Qwen3_5MoeForCausalLM" and model.config.moe.num_experts == 4
    ids = torch.tensor([SHORT])
    assert torch.equal(nexttoken.generate(model, ids, **GREEDY), hf.generate(input_ids=ids, **GREEDY))
