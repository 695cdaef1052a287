"""Llama and Mistral: the base block (pre-norms, SwiGLU, RoPE on every layer). llama.cpp writes both (and Mixtral,
SmolLM) as its `llama` architecture, with q / k rows permuted for its interleaved RoPE; a `llama` file with experts
is Mixtral."""

from __future__ import annotations

from typing import Any

from .base import Family, GGUFMeta
from .reading import every_layer_slides, gguf_need


def _gguf(g: GGUFMeta, cfg: dict[str, Any]) -> dict[str, Any]:
    if not g.get("expert_count"):
        return {}
    return {"architectures": ["MixtralForCausalLM"], "num_local_experts": int(g.get("expert_count")),
            "num_experts_per_tok": int(gguf_need(g, "expert_used_count"))}


LLAMA = Family(
    "LlamaForCausalLM", ("llama",), "Llama 2, 3, 3.1, 3.2, TinyLlama, SmolLM",
    "the base block; `llama3` and `linear` RoPE scaling; `attention_bias`, `mlp_bias`",
    gguf="llama", read_gguf=_gguf, gguf_permuted=True,
)
MISTRAL = Family(
    "MistralForCausalLM", ("mistral",), "Mistral 7B", "a sliding window on every layer",
    read=every_layer_slides,
)
