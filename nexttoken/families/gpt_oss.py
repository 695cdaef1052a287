"""gpt-oss (20B, 120B): Llama's pre-norm block with q/k/v/o biases, attention sinks (a learned logit per head
that joins each softmax), sliding (128) and full layers alternating (`layer_types`), YaRN RoPE, and a sparse MoE
MLP on every layer: a router with a bias that takes the softmax over the top k logits only, experts with biases
and a clamped SwiGLU ((up + 1) * gate * sigmoid(alpha * gate), gate <= limit, |up| <= limit). transformers'
configuration_gpt_oss.py / modeling_gpt_oss.py.

The checkpoint stacks each projection's experts in one tensor (gate/up interleaved, transposed), in the released
checkpoints as MXFP4 `*_blocks` / `*_scales`: model/weights/stacked.py unstacks them into per-expert names.
llama.cpp writes it as architecture `gpt-oss` (NeoX RoPE: no q / k permutation; experts as ffn_*_exps with
biases, MXFP4 where the checkpoint was).
"""

from __future__ import annotations

from typing import Any

from ..errors import ModelLoadError
from .base import Family, GGUFMeta
from .reading import gguf_need, layer_kinds


def _gpt_oss(raw: dict[str, Any], source: str, layers: int) -> dict[str, Any]:
    window = raw.get("sliding_window")
    types = raw.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]  # transformers' default
    if len(types) != layers:
        raise ModelLoadError(f"{source}: layer_types has {len(types)} entries for num_hidden_layers={layers}")
    experts = raw.get("num_local_experts", raw.get("num_experts"))
    moe = dict(num_experts=experts, top_k=raw.get("num_experts_per_tok"),
               intermediate_size=int(raw["intermediate_size"]), norm_topk_prob=False, router_weights_float32=False,
               shared_intermediate_size=0, sparse_layers=(True,) * layers, router_bias=True, softmax_after_topk=True)
    limit, alpha = float(raw.get("swiglu_limit", 7.0)), float(raw.get("swiglu_alpha", 1.702))
    if not limit > 0:
        raise ModelLoadError(f"{source}: swiglu_limit must be > 0, got {limit}")
    slides = [window is not None and t == "sliding_attention" for t in types]
    return {"attention_bias": bool(raw.get("attention_bias", True)), "mlp_bias": True, "attention_sinks": True,
            "swiglu_limit": limit, "swiglu_alpha": alpha, "moe": moe,
            "rope": {**raw, "rope_parameters": _rope(raw)},
            **layer_kinds(None if window is None else int(window), slides)}


def _rope(raw: dict[str, Any]) -> dict[str, Any]:
    """transformers' default for a config without rope_parameters: YaRN x32 over 4096 positions, base 150000."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling")
    if params is None:
        params = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                  "original_max_position_embeddings": 4096}
    return {"rope_theta": raw.get("rope_theta", 150000.0), **params}


def _gguf(g: GGUFMeta, cfg: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's gpt-oss keys: expert counts and width; the window's layers are transformers' default (every
    other, the first sliding: llama.cpp's swa pattern 2); YaRN as the generic reader reads it, untruncated as the
    checkpoints set it."""
    rope = cfg["rope_parameters"]
    return {"num_local_experts": int(gguf_need(g, "expert_count")),
            "num_experts_per_tok": int(gguf_need(g, "expert_used_count")),
            "intermediate_size": int(gguf_need(g, "expert_feed_forward_length")),
            "rope_parameters": rope | {"truncate": False} if rope.get("rope_type") == "yarn" else rope}


GPT_OSS = Family(
    "GptOssForCausalLM", ("gpt_oss",), "gpt-oss-20b, gpt-oss-120b",
    "q/k/v/o bias; attention sinks (a learned logit per head in each softmax); alternating sliding and full layers "
    "(`layer_types`); YaRN RoPE; a sparse MoE MLP on every layer: router with a bias, softmax over the top k "
    "logits, experts with biases and a clamped SwiGLU (`swiglu_limit`, `swiglu_alpha`); experts stacked in the "
    "checkpoint (MXFP4 `*_blocks` / `*_scales` in the released ones). Decode steps take the fused native step "
    "(experts kept packed as MXFP4: the modules path), one process (no tensor parallelism)",
    read=_gpt_oss, gguf="gpt-oss", read_gguf=_gguf, stacked_experts=True, native_step=True,
    tensor_parallel=False,
)
