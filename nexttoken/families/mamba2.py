"""Mamba2 (transformers' mamba2: Mamba-Codestral, mamba2-130m ... 2.7b): no attention at all, every layer an RMSNorm
and Mamba2's selective state space mixer (model/recurrent/ssd.py) with its residual, no MLP; `backbone.*` names,
the final norm `norm_f`. Its config has no attention heads: a placeholder of one 2-wide head keeps the shared
fields valid (no layer attends, so no K/V is ever written)."""

from __future__ import annotations

from typing import Any

from ..errors import ModelLoadError
from .base import STATE_SPACE, Family


def _number(value: Any) -> float:
    return float(value["__float__"] if isinstance(value, dict) else value)


def _mamba2(raw: dict[str, Any], source: str, layers: int) -> dict[str, Any]:
    hidden, heads, head_dim = int(raw["hidden_size"]), int(raw.get("num_heads", 128)), int(raw.get("head_dim", 64))
    if heads * head_dim != int(raw.get("expand", 2)) * hidden:
        raise ModelLoadError(f"{source}: num_heads x head_dim must be expand x hidden_size")
    groups = int(raw.get("n_groups", 8))
    limit = raw.get("time_step_limit") or (0.0, float("inf"))
    rec = {"conv_kernel": int(raw.get("conv_kernel", 4)), "conv_bias": bool(raw.get("use_conv_bias", True)),
           "mamba_num_heads": heads, "mamba_head_dim": head_dim, "mamba_state_size": int(raw.get("state_size", 128)),
           "mamba_n_groups": groups, "mamba_chunk_size": int(raw.get("chunk_size", 256)),
           "mamba_proj_bias": bool(raw.get("use_bias", False)),
           "time_step_limit": (_number(limit[0]), _number(limit[1])), "mamba_norm_groups": groups}
    return {"layers": (STATE_SPACE,) * layers, "rms_norm_eps": float(raw.get("layer_norm_epsilon", 1e-5)),
            "intermediate_size": 0, "recurrent": rec}


MAMBA2 = Family(
    "Mamba2ForCausalLM", ("mamba2",), "Mamba2, Mamba-Codestral",
    "every layer a Mamba2 mixer (a convolution window and a head_dim x state_size matrix per head per sequence), "
    "no attention, no MLP",
    read=_mamba2, tensor_parallel=False, lora=False,
    config_defaults=(("num_attention_heads", 1), ("num_key_value_heads", 1), ("head_dim", 2),
                     ("intermediate_size", 0)),
    renames=((r"^backbone\.embeddings\.", "model.embed_tokens."),
             (r"^backbone\.layers\.(\d+)\.norm\.", r"model.layers.\1.input_layernorm."),
             (r"^backbone\.layers\.(\d+)\.mixer\.", r"model.layers.\1.mamba."),
             (r"^backbone\.norm_f\.", "model.norm.")),
    state="a convolution window and a Mamba2 state matrix per head",
)
