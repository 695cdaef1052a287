"""Qwen3.5 (text, dense) and Qwen3-Next's layout: three gated-DeltaNet layers (model/recurrent/delta_rule.py) before
each attention layer (`layer_types`, or every `full_attention_interval`-th layer attention); the attention layers gate
their output by sigmoid(a second half of q_proj's rows per head), norm q and k per head, and rotate a
`partial_rotary_factor` part of each head (interleaved M-RoPE: text positions count up on all three rows, the plain
RoPE); every RMSNorm scales by (1 + w). The released checkpoints are vision-language
(Qwen3_5ForConditionalGeneration): their text model is read from `text_config` and `model.language_model.*`, the
multi-token-prediction head left out, and their vision tower (`model.visual.*`: Qwen3-VL's without DeepStack,
model/vision/qwen3_vl.py's Qwen35VisionTower; images prepared as Qwen2-VL's, images/qwen_vl.py) loaded beside it;
a Qwen3_5ForCausalLM checkpoint (no `vision_config`) has none. transformers' configuration_qwen3_5.py /
modeling_qwen3_5.py."""

from __future__ import annotations

from typing import Any

from ..errors import ModelLoadError
from .base import FULL, LINEAR_ATTENTION, Family, GGUFMeta


def _qwen35(raw: dict[str, Any], source: str, layers: int) -> dict[str, Any]:
    types = raw.get("layer_types")
    if types is None:
        interval = int(raw.get("full_attention_interval", 4))
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
    if len(types) != layers or not set(types) <= {"full_attention", "linear_attention"}:
        raise ModelLoadError(f"{source}: layer_types must name 'full_attention' or 'linear_attention' for each of "
                             f"the {layers} layers, got {types!r}")
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    factor = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.25)))
    head_dim = int(raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"])
    rec = {"conv_kernel": int(raw.get("linear_conv_kernel_dim", 4)),
           "linear_num_key_heads": int(raw.get("linear_num_key_heads", 16)),
           "linear_num_value_heads": int(raw.get("linear_num_value_heads", 32)),
           "linear_key_head_dim": int(raw.get("linear_key_head_dim", 128)),
           "linear_value_head_dim": int(raw.get("linear_value_head_dim", 128))}
    if rec["linear_num_value_heads"] % rec["linear_num_key_heads"]:
        raise ModelLoadError(f"{source}: linear_num_value_heads must be a multiple of linear_num_key_heads")
    # images (a Qwen3_5ForConditionalGeneration's): interleaved M-RoPE, transformers' default section [11, 11, 10]
    mrope = {**params, "mrope_section": params.get("mrope_section") or [11, 11, 10], "mrope_interleaved": True}
    return {"layers": tuple(LINEAR_ATTENTION if t == "linear_attention" else FULL for t in types),
            "rope": {**raw, "rope_parameters": mrope}, "qk_norm": "head", "norm_plus_one": True,
            "attention_output_gate": True, "rotary_dim": int(head_dim * factor), "recurrent": rec}


def _gguf(g: GGUFMeta, cfg: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's qwen35 keys: the recurrent layers (or the attention interval), the delta rule's sizes under
    `ssm.*` (state_size: the key head dim, group_count: key heads, time_step_rank: value heads), the rotated part
    of each head as rope.dimension_count; block_count counts the MTP layers (nextn_predict_layers), left out."""
    layers = cfg["num_hidden_layers"] - int(g.get("nextn_predict_layers") or 0)  # the MTP layers left out
    recurrent = g.get("attention.recurrent_layers")
    if isinstance(recurrent, list) and len(recurrent) >= layers:
        types = ["linear_attention" if r else "full_attention" for r in recurrent[:layers]]
    else:
        interval = int(g.get("full_attention_interval", 4))
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
    value_heads = int(g.get("ssm.time_step_rank"))
    rotated = int(g.get("rope.dimension_count") or cfg["head_dim"] // 4)
    return {"num_hidden_layers": layers, "layer_types": types, "linear_conv_kernel_dim": int(g.get("ssm.conv_kernel", 4)),
            "linear_key_head_dim": int(g.get("ssm.state_size")), "linear_num_key_heads": int(g.get("ssm.group_count")),
            "linear_num_value_heads": value_heads,
            "linear_value_head_dim": int(g.get("ssm.inner_size")) // value_heads,
            "rope_parameters": {**cfg["rope_parameters"], "partial_rotary_factor": rotated / cfg["head_dim"]}}


def _untile(t: Any, dim: int, key_heads: int, per_key: int, width: int) -> Any:
    """Undo the converter's _reorder_v_heads along `dim`: value heads in tiled order (per_key, key_heads, width)
    back to grouped by key head (key_heads, per_key, width), the checkpoint's order."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], per_key, key_heads, width, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).reshape(shape)


def _gguf_tensor(cfg: Any, name: str, t: Any) -> Any:
    """A linear-attention tensor of a qwen35 GGUF in the checkpoint's value-head order (the converter tiles the
    value heads when there are more of them than key heads)."""
    rec = cfg.recurrent
    if rec is None or ".linear_attn." not in name or rec.linear_num_value_heads == rec.linear_num_key_heads:
        return t
    k, per, dv = rec.linear_num_key_heads, rec.linear_num_value_heads // rec.linear_num_key_heads, \
        rec.linear_value_head_dim
    qk = 2 * k * rec.linear_key_head_dim  # q and k rows (or channels) come first, untouched
    if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        out = t.clone()
        out[qk:] = _untile(t[qk:], 0, k, per, dv)
        return out
    if name.endswith("in_proj_z.weight"):
        return _untile(t, 0, k, per, dv)
    if name.endswith(("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias")):
        return _untile(t, 0, k, per, 1)
    if name.endswith("out_proj.weight"):
        return _untile(t, 1, k, per, dv)
    return t


QWEN3_5 = Family(
    "Qwen3_5ForCausalLM", ("qwen3_5_text", "qwen3_5"), "Qwen3.5 dense (0.8B-27B), text (images in)",
    "gated-DeltaNet layers (`layer_types` 'linear_attention': a convolution window and a key x value matrix per "
    "head per sequence) before every `full_attention_interval`-th attention layer; attention output gated, "
    "`partial_rotary_factor` RoPE, (1 + w) norms; a Qwen3_5ForConditionalGeneration checkpoint's Qwen3-VL tower "
    "(no DeepStack) places its images by interleaved M-RoPE",
    read=_qwen35, tensor_parallel=False, gguf="qwen35", read_gguf=_gguf, gguf_norm_shift=True,
    gguf_aliases=((r"\.linear_attn\.dt_bias$", ".linear_attn.dt_proj.bias"),), gguf_tensor=_gguf_tensor,
    # the released checkpoints are Qwen3_5ForConditionalGeneration: the text model under model.language_model
    text_of=("Qwen3_5ForConditionalGeneration",),
    renames=((r"^model\.language_model\.", "model."), (r"^model\.visual\..*$", ""), (r"^mtp\..*$", "")),
    state="a convolution window and a delta-rule matrix per head", vision="qwen3_5",
)
