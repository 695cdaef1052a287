"""Tiny random-weight checkpoints of the families whose layers keep a recurrent state (issue 41), built with
transformers 5.24: several layers of each kind, sizes small enough for fast tests, weights large enough that logits
are far apart, and the parameters transformers initialises to constants (norms, dt_bias) drawn at random so they
matter."""

from __future__ import annotations

from pathlib import Path

import torch

BASE = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, initializer_range=0.3, bos_token_id=1, eos_token_id=2, pad_token_id=0,
            tie_word_embeddings=False)

# name -> (transformers model_type, config overrides)
HYBRIDS: dict[str, tuple[str, dict]] = {
    # conv, conv, attention, conv, attention, conv: the short convolution's window is conv_L_cache - 1 = 2
    "lfm2": ("lfm2", dict(num_hidden_layers=6, layer_types=["conv", "conv", "full_attention", "conv",
                                                             "full_attention", "conv"],
                          block_ff_dim=112, block_multiple_of=16, norm_eps=1e-5, tie_word_embeddings=True)),
    # three gated-DeltaNet layers before each attention layer, grouped values (4 value heads over 2 key heads),
    # the gated attention with a quarter of each head rotated
    "qwen3_5": ("qwen3_5_text", dict(num_hidden_layers=8, head_dim=32, linear_num_key_heads=2,
                                     linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                                     linear_conv_kernel_dim=4)),
}


def build_hybrid(name: str, seed: int = 0, **overrides):  # noqa: ANN201
    import transformers

    model_type, variant = HYBRIDS[name]
    cfg_cls, model_cls = {
        "lfm2": (transformers.Lfm2Config, transformers.Lfm2ForCausalLM),
        "qwen3_5_text": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM),
    }[model_type]
    cfg = cfg_cls(**{**BASE, **variant, **overrides})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname or "layernorm" in pname:  # ones or zeros at init: make every norm matter
                p.normal_(0.0 if model_type == "qwen3_5_text" else 1.0, 0.3)
            elif pname.endswith(("dt_bias", "A_log")):
                p.uniform_(-1.0, 1.0)
    return model


def save_hybrid(name: str, folder: Path, seed: int = 0, **overrides):  # noqa: ANN201
    model = build_hybrid(name, seed, **overrides)
    model.save_pretrained(folder)
    return model
