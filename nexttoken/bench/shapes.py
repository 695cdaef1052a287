"""Benchmark models: Llama shapes (and a Qwen3-MoE one) with random weights, written once as a Hugging Face folder
both engines load."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# name -> (config.json fields, default dtype). Tied embeddings, like the models in PERF_NOTES.md.
SHAPES: dict[str, tuple[dict, str]] = {
    "micro": (dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=4, vocab_size=512), "float32"),
    "tiny": (dict(hidden_size=288, intermediate_size=768, num_hidden_layers=6, num_attention_heads=6,
                  num_key_value_heads=6, vocab_size=32000), "float32"),
    "small": (dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                   num_key_value_heads=12, vocab_size=32000), "float32"),
    "1b": (dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, vocab_size=128256, rope_theta=500000.0,
                rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                  original_max_position_embeddings=8192)), "bfloat16"),
    # Qwen3-30B-A3B's proportions at a size two cores run: 64 experts, 8 chosen per token (1/8 of the expert
    # weights active), per-head q/k norms, GQA with head_dim 64. ~270M parameters, ~45M active per token.
    "moe": (dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=512,
                 intermediate_size=1536, moe_intermediate_size=256, num_experts=64, num_experts_per_tok=8,
                 norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=8,
                 num_attention_heads=8, num_key_value_heads=2, head_dim=64, vocab_size=32000,
                 rope_theta=1000000.0), "float32"),
}


def config_for(shape: str, dtype: str) -> dict:
    fields, _ = SHAPES[shape]
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": dtype, **fields,
    }


def random_checkpoint(shape: str, dtype: str, directory: Path, seed: int = 0) -> Path:
    """Write config.json + model.safetensors with N(0, 0.02) weights (norms 1) unless already there."""
    import torch  # here, not at the top: `nexttoken bench --help` reads SHAPES without importing torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    cfg = config_for(shape, dtype)
    if (directory / "model.safetensors").is_file() and json.loads((directory / "config.json").read_text()) == cfg:
        return directory
    C, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    D = cfg.get("head_dim", C // cfg["num_attention_heads"])
    q, kv = cfg["num_attention_heads"] * D, cfg["num_key_value_heads"] * D
    gen = torch.Generator().manual_seed(seed)
    tdtype = getattr(torch, dtype)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(tdtype)

    t = {"model.embed_tokens.weight": rand(V, C), "model.norm.weight": torch.ones(C, dtype=tdtype)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t |= {
            p + "input_layernorm.weight": torch.ones(C, dtype=tdtype),
            p + "post_attention_layernorm.weight": torch.ones(C, dtype=tdtype),
            p + "self_attn.q_proj.weight": rand(q, C), p + "self_attn.k_proj.weight": rand(kv, C),
            p + "self_attn.v_proj.weight": rand(kv, C), p + "self_attn.o_proj.weight": rand(C, q),
        }
        if "num_experts" in cfg:  # Qwen3-MoE: per-head q/k norms, a router and per-expert gated MLPs
            E, J = cfg["num_experts"], cfg["moe_intermediate_size"]
            t |= {p + "self_attn.q_norm.weight": torch.ones(D, dtype=tdtype),
                  p + "self_attn.k_norm.weight": torch.ones(D, dtype=tdtype), p + "mlp.gate.weight": rand(E, C)}
            for e in range(E):
                x = f"{p}mlp.experts.{e}."
                t |= {x + "gate_proj.weight": rand(J, C), x + "up_proj.weight": rand(J, C),
                      x + "down_proj.weight": rand(C, J)}
        else:
            t |= {p + "mlp.gate_proj.weight": rand(I, C), p + "mlp.up_proj.weight": rand(I, C),
                  p + "mlp.down_proj.weight": rand(C, I)}
    save_file(t, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(cfg, indent=1))
    return directory
