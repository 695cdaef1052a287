"""nexttoken vs transformers' generate on the same random weights: greedy tokens and first-step scores."""

from __future__ import annotations

import pytest
import torch

from nexttoken.generation import generate
from nexttoken.model import load_model
from support.tiny_models import HYBRID_FAMILIES, PROMPTS, VARIANTS, left_padded, save_variant


# transformers' Mamba2 keeps its layers under `backbone`, not `model` (read below): its parity, greedy, seeded and
# left-padded, is tests/model/test_hybrid_models.py's; the later hybrid families' is test_hybrid_families.py's
@pytest.fixture(scope="module", params=sorted(set(VARIANTS) - {"mamba2-ssd"} - HYBRID_FAMILIES))
def pair(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf = save_variant(request.param, directory)
    return hf, load_model(directory)


def test_greedy_tokens_identical(pair) -> None:
    hf, ours = pair
    ids, mask = left_padded(PROMPTS)
    # 40 new tokens: longer than the sliding window (5) and the llama3 original context (16).
    kwargs = dict(max_new_tokens=40, do_sample=False, eos_token_id=2, pad_token_id=0)
    expected = hf.generate(input_ids=ids, attention_mask=mask, **kwargs)
    got = generate(ours, ids, attention_mask=mask, **kwargs)
    assert got.shape == expected.shape
    assert torch.equal(got, expected)


def test_greedy_without_eos_runs_full_length(pair) -> None:
    hf, ours = pair
    ids, mask = left_padded(PROMPTS)
    kwargs = dict(max_new_tokens=25, do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = hf.generate(input_ids=ids, attention_mask=mask, **kwargs)
    got = generate(ours, ids, attention_mask=mask, **kwargs)
    assert got.shape == (3, ids.shape[1] + 25)
    assert torch.equal(got, expected)


PROCESSOR_SETTINGS = [
    dict(do_sample=False, repetition_penalty=1.3),
    dict(do_sample=True, temperature=0.7),
    dict(do_sample=True, top_k=7),
    dict(do_sample=True, top_p=0.6),
    dict(do_sample=True, min_p=0.2, top_k=0),
    dict(do_sample=True, temperature=1.5, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=0.8),
]


@pytest.mark.parametrize("settings", PROCESSOR_SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_first_step_scores_match(pair, settings) -> None:
    hf, ours = pair
    ids, mask = left_padded(PROMPTS)
    common = dict(max_new_tokens=1, output_scores=True, output_logits=True, return_dict_in_generate=True,
                  eos_token_id=2, pad_token_id=0, **settings)
    expected = hf.generate(input_ids=ids, attention_mask=mask, **common)
    got = generate(ours, ids, attention_mask=mask, **common)
    torch.testing.assert_close(got.logits[0], expected.logits[0].float(), rtol=1e-4, atol=1e-4)
    want, have = expected.scores[0], got.scores[0]
    assert torch.equal(torch.isinf(have), torch.isinf(want)), "different tokens were filtered out"
    finite = torch.isfinite(want)
    torch.testing.assert_close(have[finite], want[finite], rtol=1e-4, atol=1e-4)


def test_each_variant_exercises_its_feature(pair) -> None:
    """The variants stand for features (tied embeddings, MHA vs GQA, llama3 RoPE scaling, q/k/v bias, a sliding
    window shorter than the tests' sequences): each must really have its feature, in transformers' model and in
    ours, or the parity tests above would pass without testing it."""
    hf, ours = pair
    cfg = hf.config
    tied = hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    assert tied == cfg.tie_word_embeddings == (ours.lm_head.weight.data_ptr() == ours.embed.weight.data_ptr())
    assert ours.config.num_key_value_heads == cfg.num_key_value_heads
    rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope == "llama3":  # long-wavelength frequencies are scaled down: differ from plain RoPE's
        plain = 1.0 / (cfg.rope_parameters["rope_theta"] ** (torch.arange(0, ours.config.head_dim, 2).float()
                                                               / ours.config.head_dim))
        assert not torch.allclose(ours.inv_freq.float(), plain)
    if cfg.model_type == "qwen2":
        assert hf.model.layers[0].self_attn.q_proj.bias.abs().sum() > 0
    if cfg.model_type == "qwen3":  # per-head q/k norms with weights that are not ones, head_dim != hidden / heads
        norm = ours.layers[0].attention.q_norm
        assert norm is not None and not torch.equal(norm.weight, torch.ones_like(norm.weight))
        assert ours.config.head_dim * ours.config.num_attention_heads != ours.config.hidden_size
    if cfg.model_type == "olmo2":  # norms after the branches, q/k norms over the whole projection
        assert ours.config.norm_after and ours.layers[0].attention.q_norm.weight.shape == (
            cfg.num_attention_heads * ours.config.head_dim,)
    if cfg.model_type == "granite":  # every multiplier away from 1, so a forgotten one changes the tokens
        assert all(getattr(cfg, name) != 1.0 for name in ("embedding_multiplier", "attention_multiplier",
                                                          "residual_multiplier", "logits_scaling"))
        assert ours.config.attention_multiplier == cfg.attention_multiplier
    if cfg.model_type in ("gemma2", "gemma3_text"):  # sliding and global layers, a window shorter than the tests
        types = cfg.layer_types
        assert "sliding_attention" in types and "full_attention" in types
        assert [b.attention.sliding for b in ours.layers] == [t == "sliding_attention" for t in types]
        assert cfg.sliding_window < max(map(len, PROMPTS)) + 40 and ours.config.embed_scale == cfg.hidden_size**0.5
        assert ours.config.attention_multiplier == cfg.query_pre_attn_scalar**-0.5 != ours.config.head_dim**-0.5
        norm = ours.layers[0].attention_post_norm.weight
        assert norm.abs().sum() > 0  # (1 + w) with w away from zero
    if cfg.model_type == "gemma2":  # both soft-caps bend the numbers: scores and logits reach past the caps
        assert ours.config.attn_logit_softcapping == cfg.attn_logit_softcapping
        assert ours.config.final_logit_softcapping == cfg.final_logit_softcapping
    if cfg.model_type == "gemma3_text":  # the sliding layers' RoPE is another than the global layers' (linear x4)
        assert ours.local_inv_freq is not None and not torch.allclose(ours.local_inv_freq, ours.inv_freq)
        assert ours.config.rope.type == "linear" and ours.config.rope.factor == 4.0
    if cfg.model_type in ("mixtral", "qwen2_moe", "qwen3_moe"):  # sparse layers: top k of the experts
        moe = ours.config.moe
        assert moe is not None and 1 < moe.top_k < moe.num_experts
        assert moe.norm_topk_prob == (cfg.model_type != "qwen2_moe")
        assert (moe.shared_intermediate_size > 0) == (cfg.model_type == "qwen2_moe")
        if cfg.model_type == "qwen2_moe":  # mlp_only_layers: layer 1 is a dense MLP
            assert moe.sparse_layers == (True, False)
    if cfg.model_type == "phi3":  # fused checkpoint tensors; LongRoPE on one side of the original context or the other
        assert ours.config.architecture == "Phi3ForCausalLM"
        rope = ours.config.rope
        if rope.type == "longrope":
            widest = max(map(len, PROMPTS))
            long = rope.original_max_position_embeddings < min(map(len, PROMPTS))  # long from the prompt on
            assert long or rope.original_max_position_embeddings >= widest + 40  # or short throughout
            assert rope.attention_factor > 1.0 and not torch.allclose(ours.long_inv_freq, ours.inv_freq)
    window = getattr(cfg, "sliding_window", None)
    if cfg.model_type in ("mistral", "mixtral") or (cfg.model_type == "phi3" and window is not None):
        assert window is not None and window < max(map(len, PROMPTS)) and ours.config.sliding_window == window
