"""Qwen3-Next (Qwen3-Next-80B-A3B; transformers' qwen3_next): the layout Qwen3.5 took over (families/qwen35.py:
three gated-DeltaNet layers before each attention layer whose output is gated by sigmoid(a second half of q_proj's
rows per head), per-head q/k norms, partial RoPE, every RMSNorm zero-centred: x (1 + w)), the delta rule's input
projections as in_proj_qkvz / in_proj_ba with their rows grouped per key head (read into Qwen3.5's order at load),
and Qwen2-MoE's sparse MLP (softmax top k, renormalised where `norm_topk_prob`, a shared expert scaled by
sigmoid(shared_expert_gate)) on every `decoder_sparse_step`-th layer but `mlp_only_layers`."""

from __future__ import annotations

from typing import Any

from .base import Family
from .qwen35 import _qwen35
from .reading import qwen_moe


def _qwen3_next(raw: dict[str, Any], source: str, layers: int) -> dict[str, Any]:
    out = _qwen35(raw, source, layers)
    out["recurrent"]["linear_grouped_by_key_head"] = True
    if int(raw.get("num_experts") or 0) > 0:
        out["moe"] = qwen_moe({**raw, "norm_topk_prob": raw.get("norm_topk_prob", True)}, layers, source, shared=True)
    return out


QWEN3_NEXT = Family(
    "Qwen3NextForCausalLM", ("qwen3_next",), "Qwen3-Next (80B-A3B)",
    "gated-DeltaNet layers (in_proj_qkvz / in_proj_ba grouped per key head) before every "
    "`full_attention_interval`-th gated attention layer; (1 + w) norms; sparse MLP with a gated shared expert",
    read=_qwen3_next, tensor_parallel=False, lora=False,
    renames=((r"^mtp\..*$", ""),), state="a convolution window and a delta-rule matrix per head",
)
