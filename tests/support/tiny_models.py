"""Tiny random-weight Hugging Face checkpoints, built with transformers into a folder, for parity tests.

`initializer_range` is large so that logits are far apart: with the default 0.02 random models produce
near-ties that flip on float rounding, which would test luck rather than correctness.
"""

from __future__ import annotations

from pathlib import Path

import torch

BASE = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    initializer_range=0.3,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)

# name -> (architecture, config overrides)
VARIANTS: dict[str, tuple[str, dict]] = {
    "llama-gqa": ("llama", {}),
    "llama-tied-mha": ("llama", dict(tie_word_embeddings=True, num_key_value_heads=4)),
    "llama3-rope-scaling": (
        "llama",
        dict(
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
            head_dim=32,
        ),
    ),
    "qwen2-bias": ("qwen2", dict(tie_word_embeddings=True)),
    "mistral-sliding": ("mistral", dict(sliding_window=5)),
    "qwen3-qk-norm": ("qwen3", dict(head_dim=24)),  # head_dim != hidden / heads, as in Qwen3 checkpoints
    "olmo2-post-norm": ("olmo2", {}),
    "granite-multipliers": ("granite", dict(embedding_multiplier=3.0, attention_multiplier=0.2,
                                            residual_multiplier=0.5, logits_scaling=4.0)),
    # Gemma 2: alternating sliding (5, shorter than the sequences) and global layers, both soft-caps small enough
    # to bend the numbers, query_pre_attn_scalar != head_dim, tied embeddings, GeGLU, (1 + w) sandwich norms.
    "gemma2-softcap-sliding": ("gemma2", dict(head_dim=16, sliding_window=5, attn_logit_softcapping=4.0,
                                              final_logit_softcapping=6.0, query_pre_attn_scalar=24,
                                              tie_word_embeddings=True, num_hidden_layers=3)),
    # Gemma 3: per-head q/k norms, a local RoPE base for the sliding layers and linear scaling on the global ones.
    "gemma3-local-global-rope": ("gemma3", dict(
        head_dim=16, sliding_window=5, query_pre_attn_scalar=20, num_hidden_layers=3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0}})),
    # Mixture of experts: Mixtral (top 2 of 4, renormalised), Qwen2-MoE (a shared expert with its gate, no
    # renormalisation, a dense layer), Qwen3-MoE (top 3 of 8, norm_topk_prob, per-head q/k norms).
    "mixtral-moe": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=6)),
    "qwen2-moe-shared": ("qwen2_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                           shared_expert_intermediate_size=80, norm_topk_prob=False,
                                           mlp_only_layers=[1], tie_word_embeddings=True)),
    # Phi-3: fused qkv and gate_up checkpoints; LongRoPE in both regimes: within the original context (short factors
    # throughout) and past it from the prompt on (long factors throughout; transformers re-prefills a sequence that
    # crosses mid-generation, see docs/models.md); and a sliding-window, tied, MHA variant.
    "phi3-longrope-short": ("phi3", dict(original_max_position_embeddings=64, rope_parameters=dict(
        rope_type="longrope", rope_theta=10000.0, short_factor=[1.0 + 0.3 * i for i in range(8)],
        long_factor=[1.0 + 1.5 * i for i in range(8)]))),
    "phi3-longrope-long": ("phi3", dict(original_max_position_embeddings=2, rope_parameters=dict(
        rope_type="longrope", rope_theta=10000.0, short_factor=[1.0 + 0.3 * i for i in range(8)],
        long_factor=[1.0 + 1.5 * i for i in range(8)]))),
    "phi3-sliding-tied": ("phi3", dict(sliding_window=6, tie_word_embeddings=True, num_key_value_heads=4)),
    "phi3-plain": ("phi3", dict(sliding_window=None)),  # Llama's block from a fused checkpoint: the native step runs
    "qwen3-moe-norm-topk": ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                                              norm_topk_prob=True, head_dim=24)),
    # SmolLM3: no RoPE in every fourth layer (layer 3 of 4, transformers' and llama.cpp's default), and a variant
    # whose NoPE layers (every second) also slide over a window shorter than the tests' sequences.
    "smollm3-nope": ("smollm3", dict(num_hidden_layers=4)),
    "smollm3-nope-sliding": ("smollm3", dict(num_hidden_layers=4, no_rope_layer_interval=2, use_sliding_window=True,
                                             sliding_window=5)),
    # gpt-oss: sinks, alternating sliding (5) and full layers, 4 experts (top 2) with the clamped SwiGLU and biases,
    # YaRN (tests/model/test_gpt_oss.py has its own, more thorough model; support/gpt_oss.py).
    "gpt-oss": ("gpt_oss", dict(num_hidden_layers=3, head_dim=16, sliding_window=5, num_local_experts=4,
                                num_experts_per_tok=2, intermediate_size=48, rope_parameters=dict(
                                    rope_type="yarn", rope_theta=150000.0, factor=4.0, truncate=False,
                                    original_max_position_embeddings=32))),
    # Issue 41's hybrids (layers that keep a recurrent state; the engine's refusals for them in
    # tests/engine/test_hybrid_engine.py): LFM2's short convolutions between attention layers with per-head q/k
    # norms; Qwen3.5's three gated-DeltaNet layers before each gated attention layer, grouped values (4 value heads
    # over 2 key heads), a quarter of each head rotated.
    "lfm2-conv": ("lfm2", dict(num_hidden_layers=6, layer_types=["conv", "conv", "full_attention", "conv",
                                                                  "full_attention", "conv"],
                               block_ff_dim=112, block_multiple_of=16, norm_eps=1e-5, tie_word_embeddings=True)),
    "qwen3_5-delta": ("qwen3_5", dict(num_hidden_layers=8, head_dim=32, linear_num_key_heads=2,
                                           linear_num_value_heads=4, linear_key_head_dim=16,
                                           linear_value_head_dim=16, linear_conv_kernel_dim=4)),
    # Granite 4.0-H (dense): Mamba2 layers (4 heads of 32 over 2 groups, state 16, scan chunks of 8 so prompts
    # cross several) between NoPE attention layers, every multiplier away from 1
    "granite4h-mamba": ("granitemoehybrid", dict(
        num_hidden_layers=5, layer_types=["mamba", "attention", "mamba", "mamba", "attention"], num_local_experts=0,
        shared_intermediate_size=96, mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=2, mamba_d_state=16,
        mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8, embedding_multiplier=3.0, attention_multiplier=0.2,
        residual_multiplier=0.5, logits_scaling=4.0)),
    # Granite 4.0-H with experts (Tiny / Small): 4 experts (top 2) beside the shared MLP on every layer, RoPE on
    "granite4h-moe": ("granitemoehybrid", dict(
        num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"], num_local_experts=4, num_experts_per_tok=2,
        intermediate_size=32, shared_intermediate_size=48, mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=2,
        mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8, position_embedding_type="rope",
        embedding_multiplier=2.0, attention_multiplier=0.2, residual_multiplier=0.5, logits_scaling=2.0)),
    # LFM2-MoE: a dense first layer, then 4 experts (top 2) by sigmoid score + expert bias, renormalised, scaled
    "lfm2-moe": ("lfm2_moe", dict(num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"],
                                  num_dense_layers=1, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                  routed_scaling_factor=1.5, norm_eps=1e-5, tie_word_embeddings=True)),
    # Qwen3.5-MoE: a gated-DeltaNet layer and a gated attention layer, each with 4 experts (top 2) and a gated shared one
    "qwen3_5-moe": ("qwen3_5_moe", dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                                        head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                                        linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4,
                                        num_experts_per_tok=2, moe_intermediate_size=32,
                                        shared_expert_intermediate_size=48)),
    # Qwen3-Next: the delta rule's projections grouped per key head, a dense MLP on the first layer (mlp_only_layers)
    "qwen3_next": ("qwen3_next", dict(num_hidden_layers=3, layer_types=["linear_attention", "linear_attention",
                                                                       "full_attention"],
                                      head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                                      linear_key_head_dim=32, linear_value_head_dim=16, num_experts=4,
                                      num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[0],
                                      shared_expert_intermediate_size=48)),
    # Falcon-H1: attention and Mamba2 side by side in each of 2 layers, every µP multiplier away from 1
    "falcon_h1": ("falcon_h1", dict(num_hidden_layers=2, head_dim=16, mamba_n_heads=4, mamba_d_head=16, mamba_d_ssm=64,
                                    mamba_n_groups=2, mamba_d_state=16, mamba_chunk_size=8, mamba_rms_norm=True,
                                    key_multiplier=0.7, attention_in_multiplier=1.3, attention_out_multiplier=0.8,
                                    ssm_in_multiplier=1.2, ssm_out_multiplier=0.9,
                                    ssm_multipliers=[0.5, 1.5, 0.8, 1.2, 0.6], mlp_multipliers=[1.4, 0.6],
                                    embedding_multiplier=2.0, lm_head_multiplier=0.5)),
    # Nemotron-H: Mamba2, MLP, attention (NoPE), MLP, Mamba2: each layer one of them; relu^2 MLPs
    "nemotron_h": ("nemotron_h", dict(hybrid_override_pattern="M-*-M", head_dim=16, mamba_num_heads=4,
                                      mamba_head_dim=32, n_groups=2, ssm_state_size=16, chunk_size=8,
                                      layer_norm_epsilon=1e-5)),
    # Nemotron 3: Nemotron-H with MoE layers ('E'): 8 squared-ReLU experts in 4 groups (the best 2 groups), top 2,
    # a shared expert, scaled weights
    "nemotron_h-moe": ("nemotron_h", dict(hybrid_override_pattern="ME*-ME", head_dim=16, mamba_num_heads=4,
                                          mamba_head_dim=32, n_groups=2, ssm_state_size=16, chunk_size=8,
                                          layer_norm_epsilon=1e-5, n_routed_experts=8, num_experts_per_tok=2,
                                          moe_intermediate_size=24, moe_shared_expert_intermediate_size=40,
                                          n_group=4, topk_group=2, routed_scaling_factor=2.5)),
    # Mamba2: no attention, no MLP; 4 layers of 4 heads of 32 over 2 groups, scan chunks of 8
    "mamba2-ssd": ("mamba2", dict(num_hidden_layers=4, num_heads=4, head_dim=32, expand=2, n_groups=2, state_size=16,
                                  conv_kernel=4, chunk_size=8, layer_norm_epsilon=1e-5)),
    # OLMo 3: OLMo 2's post norms and projection q/k norms, three sliding layers (window 5) then a full one, the
    # sliding layers with a RoPE base of their own.
    "olmo3-sliding": ("olmo3", dict(num_hidden_layers=4, sliding_window=5, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
        "full_attention": {"rope_type": "default", "rope_theta": 500_000.0}})),
    # EXAONE 4: post norms, per-head q/k norms, three sliding layers (window 5) with RoPE, then a NoPE full layer.
    "exaone4-sliding-nope": ("exaone4", dict(num_hidden_layers=4, sliding_window=5, sliding_window_pattern=4)),
    # Gemma 4: sliding (window 5) and full layers with their own head_dim (32) and one KV head, keys as values on
    # the full layers, proportional partial RoPE there; the last two layers share the K/V of earlier ones with a
    # double-wide MLP; per-layer input embeddings; and a variant with the MoE block beside every MLP.
    "gemma4-kv-shared-ple": ("gemma4", dict(
        num_hidden_layers=5, head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
        sliding_window=5, layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                       "sliding_attention", "full_attention"],
        num_kv_shared_layers=2, use_double_wide_mlp=True, hidden_size_per_layer_input=32, vocab_size_per_layer_input=96,
        tie_word_embeddings=True, final_logit_softcapping=30.0)),
    "gemma4-moe": ("gemma4", dict(
        num_hidden_layers=3, head_dim=16, global_head_dim=16, sliding_window=5, hidden_size_per_layer_input=0,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], enable_moe_block=True,
        num_experts=4, top_k_experts=2, moe_intermediate_size=32, tie_word_embeddings=True)),
    # GLM-4 MoE: a dense first layer, then sigmoid routing over 4 groups of 4 (the best 2 groups), a correction
    # bias, renormalised and scaled weights, a shared expert; q/k/v biases, per-head q/k norms, half the head rotating.
    # (16 experts: a whole AVX-512 vector of router scores per row, so the sigmoid's numbers are the same for any
    # number of rows, as with the real checkpoints' 128 / 160.)
    "glm4-moe-groups": ("glm4_moe", dict(n_routed_experts=16, num_experts_per_tok=3, moe_intermediate_size=32,
                                         first_k_dense_replace=1, n_group=4, topk_group=2, n_shared_experts=1,
                                         routed_scaling_factor=2.5, attention_bias=True, use_qk_norm=True,
                                         num_hidden_layers=3, head_dim=16)),
    # ERNIE 4.5: RoPE over adjacent pairs of dims, biases on every projection; the MoE: a dense first layer, then a
    # softmax router whose correction bias moves the choice (top 3 of 8, renormalised) and a shared expert.
    "ernie4_5-pairs-bias": ("ernie4_5", dict(use_bias=True, head_dim=16)),
    "ernie4_5-moe": ("ernie4_5_moe", dict(moe_num_experts=8, moe_k=3, moe_intermediate_size=32,
                                          moe_num_shared_experts=1, moe_layer_start_index=1, num_hidden_layers=3,
                                          head_dim=16)),
}
# Variants that run one process only (their declaration refuses tensor parallelism).
NO_TENSOR_PARALLEL = {"gpt-oss"}
# The variants whose layers keep a recurrent state: speculative decoding and tensor parallelism refuse them; the
# fused native step takes them (tests/model/test_fused_recurrent.py).
# The hybrid families after the first four (tests/model/test_hybrid_families.py runs them; the suites of the first
# four, test_hybrid_models.py, test_hybrid_engine.py and the generation parity suite, leave them out).
HYBRID_FAMILIES = frozenset({"granite4h-moe", "lfm2-moe", "qwen3_5-moe", "qwen3_next", "falcon_h1", "nemotron_h",
                             "nemotron_h-moe"})
RECURRENT = frozenset({"lfm2-conv", "qwen3_5-delta", "granite4h-mamba", "mamba2-ssd"}) | HYBRID_FAMILIES


# The hybrid architectures whose random-init norms (and Mamba2 / delta-rule parameters) build_hf_model scatters: the
# centre of their norm weights (1: a plain RMSNorm's; 0: a (1 + w) norm's, or a plain one drawn about 0 as before).
HYBRIDS = {"lfm2": 1.0, "lfm2_moe": 1.0, "qwen3_5": 0.0, "qwen3_5_moe": 0.0, "qwen3_next": 0.0,
           "granitemoehybrid": 0.0, "falcon_h1": 1.0, "nemotron_h": 0.0, "mamba2": 0.0}


def declared(name: str):  # noqa: ANN201
    """The family declaration (nexttoken/families/) a variant's model belongs to."""
    from nexttoken.families import BY_MODEL_TYPE

    arch = VARIANTS[name][0]
    return BY_MODEL_TYPE.get(arch) or BY_MODEL_TYPE[arch + "_text"]


def build_hf_model(arch: str, seed: int = 0, **overrides):  # noqa: ANN201
    import transformers

    cfg_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM),
        "granite": (transformers.GraniteConfig, transformers.GraniteForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "smollm3": (transformers.SmolLM3Config, transformers.SmolLM3ForCausalLM),
        "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM),
        "lfm2": (transformers.Lfm2Config, transformers.Lfm2ForCausalLM),
        "lfm2_moe": (transformers.Lfm2MoeConfig, transformers.Lfm2MoeForCausalLM),
        "qwen3_5_moe": (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM),
        "qwen3_next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM),
        "falcon_h1": (transformers.FalconH1Config, transformers.FalconH1ForCausalLM),
        "nemotron_h": (transformers.NemotronHConfig, transformers.NemotronHForCausalLM),
        "qwen3_5": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM),
        "granitemoehybrid": (transformers.GraniteMoeHybridConfig, transformers.GraniteMoeHybridForCausalLM),
        "mamba2": (transformers.Mamba2Config, transformers.Mamba2ForCausalLM),
        "glm4_moe": (transformers.Glm4MoeConfig, transformers.Glm4MoeForCausalLM),
        "olmo3": (transformers.Olmo3Config, transformers.Olmo3ForCausalLM),
        "gemma4": (transformers.Gemma4TextConfig, transformers.Gemma4ForCausalLM),
        "exaone4": (transformers.Exaone4Config, transformers.Exaone4ForCausalLM),
        "ernie4_5": (transformers.Ernie4_5Config, transformers.Ernie4_5ForCausalLM),
        "ernie4_5_moe": (transformers.Ernie4_5_MoeConfig, transformers.Ernie4_5_MoeForCausalLM),
    }[arch]
    cfg = cfg_cls(**{**BASE, **overrides})
    cfg._attn_implementation = "eager"
    if arch == "gemma4":  # its KV heads vary by layer; the suites read the model-wide value (the sliding layers')
        cfg.allow_global_per_layer_attribute_access = True
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    if arch == "gpt_oss":
        cfg._experts_implementation = "eager"  # transformers' own loop over the experts
    # random-init biases (and gpt-oss's sinks, ERNIE 4.5 MoE's correction bias) are zero; make them matter
    if arch in ("qwen2", "qwen2_moe", "gpt_oss", "glm4_moe", "ernie4_5", "ernie4_5_moe"):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("bias", "sinks")):
                    p.normal_(0, 0.3)
    if arch in ("glm4_moe", "nemotron_h"):  # the router's correction bias (zeros at init) moves the choice
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.normal_(0, 0.3)
            for name, p in model.named_parameters():
                if name.endswith("mixer.gate.weight"):  # Nemotron 3's router (zeros at init: every score ties)
                    p.normal_(0, 0.5)
    if arch in ("qwen3", "olmo2", "qwen3_moe", "glm4_moe", "olmo3", "exaone4"):  # random-init norm weights are ones; make the q/k norms matter
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    p.normal_(1.0, 0.5)
    if arch in HYBRIDS:  # norms at ones or zeros ((1 + w): Qwen3.5), dt_bias at ones, expert biases at zeros
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(HYBRIDS[arch], 0.3)
                elif name.endswith(("dt_bias", "A_log", ".D")):
                    p.uniform_(-1.0, 1.0)
            for name, b in model.named_buffers():
                if name.endswith("expert_bias"):
                    b.normal_(0, 0.3)
    if arch == "gemma4":  # norms, scalars and per-expert scales start at ones; make every one matter
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name or name.endswith(("layer_scalar", "router.scale", "per_expert_scale")):
                    p.normal_(1.0, 0.3)
            for name, b in model.named_buffers():
                if name.endswith("layer_scalar"):
                    b.normal_(1.0, 0.3)
    if arch in ("gemma2", "gemma3"):  # Gemma's norms scale by (1 + w), w initialised to zero; make every norm matter
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(0.0, 0.5)
    return model


def save_variant(name: str, directory: Path, seed: int = 0):  # noqa: ANN201
    arch, overrides = VARIANTS[name]
    model = build_hf_model(arch, seed=seed, **overrides)
    model.save_pretrained(directory)
    return model


# Prompts of different lengths, left padded with pad id 0, as a tokenizer with padding_side="left" produces.
PROMPTS = [[1, 5, 17, 33], [1, 40, 41, 42, 43, 44, 45, 46, 47], [1, 90, 3, 3, 8, 12]]


def left_padded(prompts: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention_mask), both (B, longest), padding on the left."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def build_chat_model(folder: Path, tokenizer_dir: Path, arch: str, seed: int = 0, **overrides) -> Path:
    """A random-weight `arch` model over a real tokenizer (its files copied in, its chat template with them), for
    end-to-end chat runs: the outputs are noise, but every path (template, tokenizer, constraints) is real."""
    import json
    import shutil

    from nexttoken.text.tokenizer import Tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    for file in tokenizer_dir.iterdir():
        shutil.copy(file, folder / file.name)
    tok = Tokenizer.from_dir(folder)
    generation = tokenizer_dir / "generation_config.json"
    eos = json.loads(generation.read_text())["eos_token_id"] if generation.is_file() else tok.eos_token_id
    vocab = -(-len(tok) // 64) * 64  # checkpoints round the embedding rows up
    model = build_hf_model(arch, seed=seed, vocab_size=vocab, hidden_size=32, intermediate_size=64,
                           max_position_embeddings=4096, tie_word_embeddings=True, initializer_range=0.02,
                           bos_token_id=tok.bos_token_id, eos_token_id=eos, pad_token_id=None, **overrides)
    model.save_pretrained(folder)
    return folder
