"""Qwen3.5 (text, dense) and Qwen3-Next's layout: three gated-DeltaNet layers (model/recurrent/delta_rule.py) before
each attention layer (`layer_types`, or every `full_attention_interval`-th layer attention); the attention layers gate
their output by sigmoid(a second half of q_proj's rows per head), norm q and k per head, and rotate a
`partial_rotary_factor` part of each head (text positions: Qwen3.5's interleaved M-RoPE is the plain RoPE); every
RMSNorm scales by (1 + w). The released checkpoints are vision-language (Qwen3_5ForConditionalGeneration): their
text model is read from `text_config` and `model.language_model.*`, the vision tower and the multi-token-prediction
head left out. transformers' configuration_qwen3_5.py / modeling_qwen3_5.py."""

from __future__ import annotations

from typing import Any

from ..errors import ModelLoadError
from .base import FULL, LINEAR_ATTENTION, Family


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
    return {"layers": tuple(LINEAR_ATTENTION if t == "linear_attention" else FULL for t in types),
            "qk_norm": "head", "norm_plus_one": True, "attention_output_gate": True,
            "rotary_dim": int(head_dim * factor), "recurrent": rec}


QWEN3_5 = Family(
    "Qwen3_5ForCausalLM", ("qwen3_5_text", "qwen3_5"), "Qwen3.5 dense (0.8B-27B), text",
    "gated-DeltaNet layers (`layer_types` 'linear_attention': a convolution window and a key x value matrix per "
    "head per sequence) before every `full_attention_interval`-th attention layer; attention output gated, "
    "`partial_rotary_factor` RoPE, (1 + w) norms",
    read=_qwen35, tensor_parallel=False,
    # the released checkpoints are Qwen3_5ForConditionalGeneration: the text model under model.language_model
    text_of=("Qwen3_5ForConditionalGeneration",),
    renames=((r"^model\.language_model\.", "model."), (r"^model\.visual\..*$", ""), (r"^mtp\..*$", "")),
    state="a convolution window and a delta-rule matrix per head",
)
