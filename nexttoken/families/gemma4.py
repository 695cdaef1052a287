"""Gemma 4 (the text model, `gemma4_text`): Gemma 3's sandwich-normed GeGLU block and alternating sliding / full
layers, plus (transformers' configuration_gemma4.py / modeling_gemma4.py, 5.24):

- the full layers' own head_dim (`global_head_dim`, 512 by default) and KV heads (`num_global_key_value_heads`,
  where `attention_k_eq_v`), as the saved `per_layer_config` records them;
- keys reused as values on the full layers (`attention_k_eq_v`: no v_proj there), every layer's values RMS-normed
  without a scale, q/k norms scaling by `w` (not 1 + w), attention scale 1;
- RoPE per layer type: the sliding layers' default one, the full layers' "proportional" one (a
  `partial_rotary_factor` share of the frequencies, the others zero);
- KV sharing: the last `num_kv_shared_layers` layers keep no K/V of their own and attend the K/V of the last earlier
  layer of their type (their MLP twice as wide with `use_double_wide_mlp`);
- per-layer input embeddings (`hidden_size_per_layer_input`): a packed (vocab, layers x P) table plus a projection
  of the embeddings, added into each layer's output through its own gate and projection; a learned `layer_scalar`;
- the optional MoE block (`enable_moe_block`) beside the dense MLP: a softmax router on the normed, scaled residual
  with per-expert scales, experts stored as (E, 2I, C) / (E, C, I) tensors, both branches post-normed and summed.

nexttoken runs it through its own modules (model/gemma4.py): the fused native step, tensor parallelism and LoRA are
refused for it by this declaration. llama.cpp's `gemma4` GGUF files are not read yet.
"""

from __future__ import annotations

from typing import Any

from ..errors import ModelLoadError
from .base import FULL, LOCAL_SLIDING, Family
from .reading import cap, layer_kinds


def _per_layer(raw: dict[str, Any], types: list[str]) -> tuple[int, int | None]:
    """(the full layers' head_dim, their KV heads or None: the model's), from the saved per_layer_config or, as
    transformers derives it, from global_head_dim and num_global_key_value_heads."""
    entries = raw.get("per_layer_config")
    if entries is not None:  # as saved: only the overrides that differ from the model's (possibly none)
        full = [entries.get(str(i)) or entries.get(i) or {} for i, t in enumerate(types) if t == "full_attention"]
        dims = {e.get("head_dim") for e in full} - {None}
        heads = {e.get("num_key_value_heads") for e in full} - {None}
        if len(dims) > 1 or len(heads) > 1:
            raise ModelLoadError("per_layer_config gives the full layers different shapes; not supported")
        return (dims.pop() if dims else int(raw.get("head_dim", 256))), (heads.pop() if heads else None)
    heads = raw.get("num_global_key_value_heads") if raw.get("attention_k_eq_v", False) else None
    return int(raw.get("global_head_dim", 512)), heads


def _gemma4(raw: dict[str, Any], source: str, layers: int) -> dict[str, Any]:
    types = list(raw.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention"
                                            for i in range(layers)])
    if len(types) != layers:
        raise ModelLoadError(f"{source}: layer_types has {len(types)} entries for num_hidden_layers={layers}")
    types[-1] = "full_attention"  # transformers forces the last layer full
    if raw.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{source}: use_bidirectional_attention is not supported (decoders attend causally)")
    shared = int(raw.get("num_kv_shared_layers") or 0)
    first_shared = layers - shared
    if shared and (shared >= layers or set(types[:first_shared]) != set(types)):
        raise ModelLoadError(f"{source}: num_kv_shared_layers={shared} needs an earlier layer of each type to share")
    head_dim, heads = _per_layer(raw, types)
    params = raw.get("rope_parameters") or {}
    full = {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0,
            **(params.get("full_attention") or {})}
    local = {"rope_type": "default", "rope_theta": 10_000.0, **(params.get("sliding_attention") or {})}
    out = {"norm_plus_one": False, "sandwich_norm": True, "embed_scale": int(raw["hidden_size"]) ** 0.5,
           "attention_multiplier": 1.0, "final_logit_softcapping": cap(raw, "final_logit_softcapping", source),
           "qk_norm": "head", "global_head_dim": head_dim, "global_kv_heads": heads,
           "values_from_keys": bool(raw.get("attention_k_eq_v", False)), "kv_shared_layers": shared,
           "double_wide_mlp": bool(raw.get("use_double_wide_mlp", False)),
           "per_layer_input": int(raw.get("hidden_size_per_layer_input") or 0),
           "per_layer_vocab": int(raw.get("vocab_size_per_layer_input") or raw["vocab_size"]),
           "rope": {"rope_parameters": full}, "rope_local": {"rope_parameters": local},
           **layer_kinds(int(raw.get("sliding_window", 512)), [t == "sliding_attention" for t in types],
                         LOCAL_SLIDING, FULL)}
    if raw.get("enable_moe_block"):
        out["moe"] = dict(num_experts=raw.get("num_experts"), top_k=raw.get("top_k_experts"),
                          intermediate_size=int(raw.get("moe_intermediate_size") or 0), norm_topk_prob=True,
                          router_weights_float32=True, sparse_layers=(True,) * layers, scoring="scaled_softmax")
    return out


GEMMA4 = Family(
    "Gemma4ForCausalLM", ("gemma4_text",), "Gemma 4 text (E2B, E4B, 26B-A4B, 31B: the text model)",
    "Gemma 3's block with q/k norms scaling by `w`, values RMS-normed, attention scale 1; the full layers' own "
    "`global_head_dim` / KV heads and keys reused as values (`attention_k_eq_v`); proportional partial RoPE on the "
    "full layers; KV shared by the last `num_kv_shared_layers` layers (no cache of their own; double-wide MLP "
    "with `use_double_wide_mlp`); per-layer input embeddings (`hidden_size_per_layer_input`); `layer_scalar`; the "
    "optional MoE block beside the MLP (`enable_moe_block`); modules path",
    read=_gemma4, native_step=False, tensor_parallel=False, lora=False, network="gemma4",
)
