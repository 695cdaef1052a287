"""Gemma 2 and Gemma 3 (text): GeGLU, RMSNorm scaling by (1 + w) in float32, norms before and after each branch,
embeddings x sqrt(hidden), soft-capped scores (Gemma 2) and logits, alternating sliding and global layers; Gemma 3
adds per-head q/k norms and a RoPE of its own for the sliding layers. llama.cpp stores the norms as 1 + w."""

from __future__ import annotations

from typing import Any

from ..errors import ModelLoadError
from .base import LOCAL_SLIDING, SLIDING, Family, GGUFMeta, LayerKind
from .reading import cap, layer_kinds


def _common(raw: dict[str, Any], source: str, layers: int, pattern: int, slide: LayerKind) -> dict[str, Any]:
    scalar = float(raw.get("query_pre_attn_scalar", 256))
    if not scalar > 0:
        raise ModelLoadError(f"{source}: query_pre_attn_scalar must be > 0, got {scalar}")
    out = {"norm_plus_one": True, "sandwich_norm": True, "embed_scale": int(raw["hidden_size"]) ** 0.5,
           "attention_multiplier": scalar**-0.5, "final_logit_softcapping": cap(raw, "final_logit_softcapping", source)}
    window = raw.get("sliding_window")
    if window is None:
        return out
    types = raw.get("layer_types")  # alternating sliding and global layers: layer_types, or the older pattern
    if types is None:
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if len(types) != layers:
        raise ModelLoadError(f"{source}: layer_types has {len(types)} entries for num_hidden_layers={layers}")
    return out | layer_kinds(int(window), [t == "sliding_attention" for t in types], slide)


def _gemma2(raw: dict[str, Any], source: str, layers: int) -> dict[str, Any]:
    return {**_common(raw, source, layers, 2, SLIDING),
            "attn_logit_softcapping": cap(raw, "attn_logit_softcapping", source)}


def _gemma3(raw: dict[str, Any], source: str, layers: int) -> dict[str, Any]:
    """Two RoPEs: the global layers' and the sliding layers'. transformers 5 writes rope_parameters keyed by layer
    type; older configs write rope_theta + rope_scaling (global) and rope_local_base_freq (sliding)."""
    params = raw.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = {"rope_theta": 1_000_000.0, **params.get("full_attention", {})}
        local = {"rope_theta": 10_000.0, **params.get("sliding_attention", {})}
    else:
        full = {**(raw.get("rope_scaling") or {}), "rope_theta": raw.get("rope_theta", 1_000_000.0)}
        local = {"rope_theta": raw.get("rope_local_base_freq", 10_000.0)}
    return {**_common(raw, source, layers, int(raw.get("sliding_window_pattern", 6)), LOCAL_SLIDING),
            "qk_norm": "head", "rope": {"rope_parameters": full}, "rope_local": {"rope_parameters": local}}


def _gguf(g: GGUFMeta, cfg: dict[str, Any], big_at: int) -> dict[str, Any]:
    """llama.cpp's f_attention_scale: 1/sqrt(hidden / heads) for the 27B models (`big_at` layers), else
    1/sqrt(head_dim)."""
    hidden, heads, layers = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"]
    return {"hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": hidden // heads if layers == big_at else cfg["head_dim"]}


def _gguf_gemma2(g: GGUFMeta, cfg: dict[str, Any]) -> dict[str, Any]:
    return {**_gguf(g, cfg, 46), "attn_logit_softcapping": g.get("attn_logit_softcapping", 50.0),
            "final_logit_softcapping": g.get("final_logit_softcapping", 30.0)}


def _gguf_gemma3(g: GGUFMeta, cfg: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's Gemma 3: five sliding layers then a global one; the local RoPE's base is 10000."""
    return {**_gguf(g, cfg, 62), "sliding_window_pattern": 6, "final_logit_softcapping": g.get("final_logit_softcapping"),
            "rope_theta": float(g.get("rope.freq_base", 1_000_000.0)), "rope_local_base_freq": 10_000.0,
            "rope_parameters": None, "rope_scaling": cfg["rope_parameters"]}


GEMMA2 = Family(
    "Gemma2ForCausalLM", ("gemma2",), "Gemma 2",
    "GeGLU (`gelu_pytorch_tanh`); RMSNorm scaling by `1 + weight` in float32; norms before *and* after each branch; "
    "embeddings x sqrt(hidden) (rounded to the weights' dtype, as transformers does); attention scores and final "
    "logits soft-capped (`cap * tanh(x / cap)`); alternating sliding and global layers (`layer_types`); attention "
    "scale `query_pre_attn_scalar ** -0.5`",
    read=_gemma2, gguf="gemma2", read_gguf=_gguf_gemma2, gguf_norm_shift=True,
)
GEMMA3 = Family(
    "Gemma3ForCausalLM", ("gemma3_text",), "Gemma 3 text (1B, and the text tower's config of the larger ones)",
    "Gemma 2's block without attention soft-capping, plus q/k norms per head; sliding layers rotate with their own "
    "RoPE base (`rope_parameters[\"sliding_attention\"]` or `rope_local_base_freq`), global layers with theirs and "
    "its scaling (`linear` on the 4B+ checkpoints); `sliding_window_pattern` read where `layer_types` is absent",
    read=_gemma3, gguf="gemma3", read_gguf=_gguf_gemma3, gguf_norm_shift=True,
)
GEMMA3_VISION = Family(
    "Gemma3ForConditionalGeneration", ("gemma3",), "Gemma 3 4B / 12B / 27B (images in)",
    "Gemma 3's text model (`text_config`) with a SigLIP vision tower and its projector (average-pooled to "
    "`mm_tokens_per_image` soft tokens, RMS-normed, projected); an image's tokens attend each other both ways "
    "during prefill (transformers' `token_type_ids`)",
    read=_gemma3, vision="gemma3",
    # the released config.json's text_config lists only what differs from Gemma3TextConfig's defaults
    config_defaults=(("vocab_size", 262208), ("hidden_size", 2304), ("intermediate_size", 9216),
                     ("num_hidden_layers", 26), ("num_attention_heads", 8), ("num_key_value_heads", 4),
                     ("head_dim", 256), ("hidden_activation", "gelu_pytorch_tanh"), ("max_position_embeddings", 131072),
                     ("rms_norm_eps", 1e-6), ("query_pre_attn_scalar", 256), ("sliding_window", 4096),
                     ("tie_word_embeddings", True), ("bos_token_id", 2), ("eos_token_id", 1), ("pad_token_id", 0)),
    renames=((r"^(model\.language_model|language_model\.model)\.", "model."),
             (r"^language_model\.lm_head\.", "lm_head."),
             (r"^(model\.)?(vision_tower|multi_modal_projector)\..*$", "")),
)
