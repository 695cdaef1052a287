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

nexttoken runs it through its own modules (model/gemma4.py), whose decode steps take the fused native step (its block
is a layer form of its own there: model/fused.py's _gemma4_layer); tensor parallelism and LoRA are refused for it by
this declaration. llama.cpp's `gemma4` GGUF files are read back into the same config (_gguf):
per-layer KV heads and MLP widths, both head dims, the sliding pattern, the KV-shared count, the per-layer inputs,
keys-as-values by the full layers' missing attn_v, the full layers' proportional RoPE from `rope_freqs` (1 for a
rotated frequency, 1e30 for the others), the MoE block's stacked experts and router scales under llama.cpp's names
(gguf_aliases). A quantized file keeps its matrices, token tables and stacked experts in their blocks
(weights/gguf_packed.py: GGUF_PACKED in model/gemma4.py; the experts one GGUFLinear each, Gemma4Experts.keep).
"""

from __future__ import annotations

from typing import Any

from ..errors import ModelLoadError
from .base import FULL, LOCAL_SLIDING, Family, GGUFMeta
from .reading import cap, gguf_need, layer_kinds


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
    if raw.get("use_bidirectional_attention") not in (None, False, "vision"):  # "vision": the tower's business
        raise ModelLoadError(f"{source}: use_bidirectional_attention={raw['use_bidirectional_attention']!r} is not "
                             "supported (Gemma 4 decoders attend causally, but for \"vision\": an image's tokens "
                             "each other on the sliding layers)")
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
           "per_layer_vocab": int(raw.get("vocab_size_per_layer_input") or raw["vocab_size"])
           if raw.get("hidden_size_per_layer_input") else 0,  # (0: no per-layer inputs, ModelConfig's default)
           "rope": {"rope_parameters": full}, "rope_local": {"rope_parameters": local},
           **layer_kinds(int(raw.get("sliding_window", 512)), [t == "sliding_attention" for t in types],
                         LOCAL_SLIDING, FULL)}
    if raw.get("enable_moe_block"):
        out["moe"] = dict(num_experts=raw.get("num_experts"), top_k=raw.get("top_k_experts"),
                          intermediate_size=int(raw.get("moe_intermediate_size") or 0), norm_topk_prob=True,
                          router_weights_float32=True, sparse_layers=(True,) * layers, scoring="scaled_softmax")
    return out


def _per_layer_values(g: GGUFMeta, key: str, layers: int) -> list[Any]:
    value = gguf_need(g, key)
    return list(value) if isinstance(value, list) else [value] * layers


def _gguf(g: GGUFMeta, cfg: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's gemma4 keys (conversion/gemma.py's Gemma4Model) as transformers' Gemma4TextConfig fields."""
    layers = cfg["num_hidden_layers"]
    slides = [bool(s) for s in _per_layer_values(g, "attention.sliding_window_pattern", layers)]
    kv = [int(k) for k in _per_layer_values(g, "attention.head_count_kv", layers)]
    widths = [int(w) for w in _per_layer_values(g, "feed_forward_length", layers)]
    shared = int(g.get("attention.shared_kv_layers") or 0)
    head_full = int(gguf_need(g, "attention.key_length"))
    head_swa = int(g.get("attention.key_length_swa") or head_full)
    swa_kv, full_kv = {k for k, s in zip(kv, slides) if s}, {k for k, s in zip(kv, slides) if not s}
    if len(swa_kv) > 1 or len(full_kv) > 1:
        raise ModelLoadError(f"{g.path}: KV heads differ between layers of one type ({kv}); not supported")
    full = [i for i in range(layers - shared) if not slides[i]]
    keys_as_values = bool(full) and f"blk.{full[0]}.attn_v.weight" not in g.tensors
    rotated = int(g.get("rope.dimension_count") or head_full)
    if "rope_freqs.weight" in g.tensors:  # 1 where a full layer's frequency rotates, 1e30 where it does not
        rotated = 2 * int((g.tensors["rope_freqs.weight"].data == 1.0).sum())
    local = {"rope_type": "default", "rope_theta": float(g.get("rope.freq_base_swa") or 10_000.0)}
    if int(g.get("rope.dimension_count_swa") or head_swa) != head_swa:
        local["partial_rotary_factor"] = int(g.get("rope.dimension_count_swa")) / head_swa
    embed = g.tensors.get("per_layer_token_embd.weight")
    out = {"hidden_activation": "gelu_pytorch_tanh", "head_dim": head_swa,
           "layer_types": ["sliding_attention" if s else "full_attention" for s in slides],
           "global_head_dim": head_full, "num_key_value_heads": (swa_kv or full_kv).pop(),
           "attention_k_eq_v": keys_as_values, "num_kv_shared_layers": shared, "intermediate_size": widths[0],
           "use_double_wide_mlp": shared > 0 and widths[-1] == 2 * widths[0] != widths[0],
           "hidden_size_per_layer_input": int(g.get("embedding_length_per_layer_input") or 0),
           "final_logit_softcapping": g.get("final_logit_softcapping"),
           "rope_parameters": {"sliding_attention": local, "full_attention": {
               "rope_type": "proportional", "rope_theta": float(g.get("rope.freq_base") or 1_000_000.0),
               "partial_rotary_factor": rotated / head_full}}}
    if keys_as_values and full_kv:
        out["num_global_key_value_heads"] = full_kv.pop()
    if embed is not None:
        out["vocab_size_per_layer_input"] = int(embed.shape[-1])
    if g.get("expert_count"):
        out |= {"enable_moe_block": True, "num_experts": int(g.get("expert_count")),
                "top_k_experts": int(gguf_need(g, "expert_used_count")),
                "moe_intermediate_size": int(gguf_need(g, "expert_feed_forward_length"))}
    return out


GEMMA4 = Family(
    "Gemma4ForCausalLM", ("gemma4_text",), "Gemma 4 text (E2B, E4B, 26B-A4B, 31B: the text model)",
    "Gemma 3's block with q/k norms scaling by `w`, values RMS-normed, attention scale 1; the full layers' own "
    "`global_head_dim` / KV heads and keys reused as values (`attention_k_eq_v`); proportional partial RoPE on the "
    "full layers; KV shared by the last `num_kv_shared_layers` layers (no cache of their own; double-wide MLP "
    "with `use_double_wide_mlp`); per-layer input embeddings (`hidden_size_per_layer_input`); `layer_scalar`; the "
    "optional MoE block beside the MLP (`enable_moe_block`); decode steps take the fused native step",
    read=_gemma4, native_step=True, tensor_parallel=False, lora=False, network="gemma4", gguf="gemma4",
    read_gguf=_gguf, gguf_per_layer=True,
    # llama.cpp's converter names layer_scalar with a `.weight`, and writes the MoE block's tensors under its own
    # names (Gemma4Model.modify_tensors): stacked experts as they are, the router's scales beside its matrix
    gguf_aliases=((r"\.layer_scalar$", ".layer_scalar.weight"),
                  (r"^model\.layers\.(\d+)\.experts\.(gate_up|down)_proj$", r"blk.\1.ffn_\2_exps.weight"),
                  (r"^model\.layers\.(\d+)\.router\.proj\.weight$", r"blk.\1.ffn_gate_inp.weight"),
                  (r"^model\.layers\.(\d+)\.router\.scale$", r"blk.\1.ffn_gate_inp.scale"),
                  (r"^model\.layers\.(\d+)\.router\.per_expert_scale$", r"blk.\1.ffn_down_exps.scale")),
)
GEMMA4_VISION = Family(
    "Gemma4ForConditionalGeneration", ("gemma4",), "Gemma 4 (images in)",
    "Gemma 4's text model (`text_config`) with its vision tower: patches at each image's own aspect ratio (up to "
    "`max_soft_tokens` x pooling_kernel_size^2), learned x / y embeddings, 2-D axial RoPE, q / k / v RMS-normed, "
    "k x k average pooling, an RMS-normed projection (`embed_vision`); image tokens attend causally, or with "
    "`use_bidirectional_attention: \"vision\"` each other both ways on the sliding layers during the prefill; the "
    "audio tower is not read; decode steps take the fused native step (the images come in during the "
    "prefill)",
    read=_gemma4, native_step=True, tensor_parallel=False, lora=False, network="gemma4", vision="gemma4",
    renames=((r"^model\.language_model\.", "model."),
             (r"^(model\.)?(vision_tower|embed_vision|audio_tower|embed_audio)\..*$", "")),
)
