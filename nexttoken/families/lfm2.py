"""LFM2 and LFM2.5 (Liquid AI): gated short convolutions (model/recurrent/short_conv.py) between attention layers
with per-head q/k norms; a SwiGLU MLP (`feed_forward.w1 / w3 / w2`) whose width `block_auto_adjust_ff_dim` derives
from `block_ff_dim`; the final norm is called `embedding_norm`. transformers' configuration_lfm2.py /
modeling_lfm2.py."""

from __future__ import annotations

from typing import Any

from ..errors import ModelLoadError
from .base import CONVOLUTION, FULL, Family, GGUFMeta


def _width(raw: dict[str, Any]) -> int:
    """The MLP's width as Lfm2MLP computes it: 2/3 of block_ff_dim, times the multiplier, up to block_multiple_of."""
    width = int(raw.get("block_ff_dim", raw.get("intermediate_size", 12288)))
    if raw.get("block_auto_adjust_ff_dim", True):
        width = int(2 * width / 3)
        multiplier = raw.get("block_ffn_dim_multiplier", 1.0)
        if multiplier is not None:
            multiple = int(raw.get("block_multiple_of", 256))
            width = int(multiplier * width)
            width = multiple * ((width + multiple - 1) // multiple)
    return width


def _lfm2(raw: dict[str, Any], source: str, layers: int) -> dict[str, Any]:
    types = raw.get("layer_types")
    if types is None:
        full = raw.get("full_attn_idxs")
        full = set(range(layers) if full is None else full)
        types = ["full_attention" if i in full else "conv" for i in range(layers)]
    if len(types) != layers or not set(types) <= {"full_attention", "conv"}:
        raise ModelLoadError(f"{source}: layer_types must name 'full_attention' or 'conv' for each of the "
                             f"{layers} layers, got {types!r}")
    return {"layers": tuple(CONVOLUTION if t == "conv" else FULL for t in types), "qk_norm": "head",
            "intermediate_size": _width(raw), "rms_norm_eps": float(raw.get("norm_eps", 1e-5)),
            "tie_word_embeddings": bool(raw.get("tie_word_embeddings", raw.get("tie_embedding", True))),
            "recurrent": {"conv_kernel": int(raw.get("conv_L_cache", 3)), "conv_bias": bool(raw.get("conv_bias", False))}}


def _gguf(g: GGUFMeta, cfg: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's lfm2 keys: a KV head count per layer, 0 for the convolution layers; the MLP width as computed."""
    kv = g.get("attention.head_count_kv")
    layers = cfg["num_hidden_layers"]
    kv = kv if isinstance(kv, list) else [kv] * layers
    return {"layer_types": ["conv" if not k else "full_attention" for k in kv],
            "conv_L_cache": int(g.get("shortconv.l_cache", 3)), "block_auto_adjust_ff_dim": False,
            "block_ff_dim": cfg["intermediate_size"], "norm_eps": cfg["rms_norm_eps"]}


LFM2 = Family(
    "Lfm2ForCausalLM", ("lfm2",), "LFM2, LFM2.5 (350M-2.6B)",
    "gated short-convolution layers (`layer_types` 'conv', a window of `conv_L_cache` - 1 inputs per sequence) "
    "between attention layers with per-head q/k norms; MLP width from `block_ff_dim`",
    read=_lfm2, tensor_parallel=False, gguf="lfm2", read_gguf=_gguf,
    gguf_aliases=((r"^model\.norm\.weight$", "model.embedding_norm.weight"),),
    renames=((r"\.operator_norm\.", ".input_layernorm."), (r"\.ffn_norm\.", ".post_attention_layernorm."),
             (r"\.feed_forward\.w1\.", ".mlp.gate_proj."), (r"\.feed_forward\.w3\.", ".mlp.up_proj."),
             (r"\.feed_forward\.w2\.", ".mlp.down_proj."), (r"\.self_attn\.q_layernorm\.", ".self_attn.q_norm."),
             (r"\.self_attn\.k_layernorm\.", ".self_attn.k_norm."), (r"\.self_attn\.out_proj\.", ".self_attn.o_proj."),
             (r"^model\.embedding_norm\.", "model.norm.")),
    state="a convolution window",
)
