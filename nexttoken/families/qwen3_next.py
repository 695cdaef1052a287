"""Qwen3-Next (Qwen3-Next-80B-A3B; transformers' qwen3_next): the layout Qwen3.5 took over (families/qwen35.py:
three gated-DeltaNet layers before each attention layer whose output is gated by sigmoid(a second half of q_proj's
rows per head), per-head q/k norms, partial RoPE, every RMSNorm zero-centred: x (1 + w)), the delta rule's input
projections as in_proj_qkvz / in_proj_ba with their rows grouped per key head (read into Qwen3.5's order at load),
and Qwen2-MoE's sparse MLP (softmax top k, renormalised where `norm_topk_prob`, a shared expert scaled by
sigmoid(shared_expert_gate)) on every `decoder_sparse_step`-th layer but `mlp_only_layers`."""

from __future__ import annotations

from typing import Any

from .base import Family, GGUFMeta
from .qwen35 import QWEN3_5, _gguf as _qwen35_gguf, _qwen35
from .reading import gguf_need, gguf_qwen_moe, qwen_moe


def _qwen3_next(raw: dict[str, Any], source: str, layers: int) -> dict[str, Any]:
    out = _qwen35(raw, source, layers)
    out["recurrent"]["linear_grouped_by_key_head"] = True
    if int(raw.get("num_experts") or 0) > 0:
        out["moe"] = qwen_moe({**raw, "norm_topk_prob": raw.get("norm_topk_prob", True)}, layers, source, shared=True)
    return out


def _gguf(g: GGUFMeta, cfg: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's qwen3next keys: Qwen3.5's (families/qwen35.py: the recurrent layers, the delta rule's sizes under
    ssm.*), the experts' and the shared expert's (every layer sparse: the converter cannot write a dense MLP layer;
    the top k renormalised, as the released checkpoints' norm_topk_prob)."""
    return {**_qwen35_gguf(g, cfg), **gguf_qwen_moe(g, norm_topk_prob=True),
            "shared_expert_intermediate_size": int(gguf_need(g, "expert_shared_feed_forward_length"))}


def _gguf_tensor(cfg: Any, name: str, t: Any) -> Any:
    """in_proj_qkvz from the converter's attn_qkv and attn_gate stacked ([q; k; v; z], each grouped by key head:
    Qwen3.5's order) back to the checkpoint's rows grouped per key head h: q_h, k_h, v_h, z_h. The converter keeps
    in_proj_ba as it is and does not tile the value heads for qwen3next."""
    if not name.endswith("in_proj_qkvz.weight"):
        return t
    rec = cfg.recurrent
    hk, dk = rec.linear_num_key_heads, rec.linear_key_head_dim
    vz = rec.linear_num_value_heads * rec.linear_value_head_dim // hk  # one key head's v (or z) rows
    key, C = hk * dk, t.shape[-1]
    out = t.new_empty(hk, 2 * dk + 2 * vz, C)
    out[:, :dk], out[:, dk:2 * dk] = t[:key].reshape(hk, dk, C), t[key:2 * key].reshape(hk, dk, C)
    out[:, 2 * dk:2 * dk + vz] = t[2 * key:2 * key + hk * vz].reshape(hk, vz, C)
    out[:, 2 * dk + vz:] = t[2 * key + hk * vz:].reshape(hk, vz, C)
    return out.reshape(-1, C)


QWEN3_NEXT = Family(
    "Qwen3NextForCausalLM", ("qwen3_next",), "Qwen3-Next (80B-A3B)",
    "gated-DeltaNet layers (in_proj_qkvz / in_proj_ba grouped per key head) before every "
    "`full_attention_interval`-th gated attention layer; (1 + w) norms; sparse MLP with a gated shared expert",
    read=_qwen3_next, tensor_parallel=False, gguf="qwen3next", read_gguf=_gguf, gguf_norm_shift=True,
    gguf_aliases=QWEN3_5.gguf_aliases, gguf_tensor=_gguf_tensor,
    gguf_joined=(("linear_attn.in_proj_qkvz.weight", ("attn_qkv.weight", "attn_gate.weight")),),
    renames=((r"^mtp\..*$", ""),), state="a convolution window and a delta-rule matrix per head",
)
