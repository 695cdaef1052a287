"""Tiny GGUF files written as llama.cpp's converter writes them, with the `gguf` package (no tests here)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

# variant -> GGUF architecture; the MoE variant without a dense layer (llama.cpp's qwen2moe has none), Gemma 3 with
# llama.cpp's fixed local RoPE base.
FAMILIES = {
    "llama-gqa": "llama", "qwen2-bias": "qwen2", "qwen3-qk-norm": "qwen3", "olmo2-post-norm": "olmo2",
    "granite-multipliers": "granite", "gemma2-softcap-sliding": "gemma2", "gemma3": "gemma3",
    "mixtral-moe": "llama", "qwen2-moe": "qwen2moe", "qwen3-moe-norm-topk": "qwen3moe", "phi3-plain": "phi3",
    "smollm3-nope": "smollm3",
}


def write_model(path: Path, arch: str, hf, quant: str | None = None) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """The checkpoint as llama.cpp's converter writes it; returns the weights as the file holds them (dequantized),
    by checkpoint name, for the reference."""
    from safetensors.torch import load_file

    hf.save_pretrained(path.parent / "folder")
    state = load_file(path.parent / "folder" / "model.safetensors")
    c = hf.config
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_key_length(head_dim), w.add_value_length(head_dim)
    theta = (c.rope_parameters.get("full_attention", c.rope_parameters) if c.rope_parameters else {}).get(
        "rope_theta", 10000.0)
    w.add_rope_freq_base(theta)
    w.add_vocab_size(c.vocab_size)
    if getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None):
        w.add_expert_count(getattr(c, "num_local_experts", None) or c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
    if getattr(c, "moe_intermediate_size", None):
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    if getattr(c, "shared_expert_intermediate_size", None):
        w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    if arch in ("gemma2", "gemma3"):
        w.add_sliding_window(c.sliding_window)
        if arch == "gemma2":
            w.add_attn_logit_softcapping(c.attn_logit_softcapping)
            w.add_final_logit_softcapping(c.final_logit_softcapping)
    if arch == "granite":
        w.add_embedding_scale(c.embedding_multiplier), w.add_residual_scale(c.residual_multiplier)
        w.add_attention_scale(c.attention_multiplier), w.add_logit_scale(c.logits_scaling)
    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch),
                                     c.num_hidden_layers)
    held: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for name, t in state.items():
        base, suffix = name.rsplit(".", 1)
        x = t.float().numpy()
        if quant and x.ndim == 2 and x.shape[1] % 32 == 0 and "norm" not in name:
            x = dequantize(quantize(x, T[quant]), T[quant])  # rows quantize independently: held = what the file has
        held[name] = torch.from_numpy(x.copy())
        if ".experts." in base:
            layer, expert, proj = int(base.split(".")[2]), int(base.split(".")[-2]), base.split(".")[-1]
            part = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up"}.get(proj, "down")
            experts.setdefault(f"blk.{layer}.ffn_{part}_exps.weight", {})[expert] = x
            continue
        g = names.get_name(base)
        if g is None and base.endswith("block_sparse_moe.gate"):
            g = f"blk.{base.split('.')[2]}.ffn_gate_inp"
        assert g is not None, name
        if arch in ("llama", "granite", "smollm3") and g.endswith(("attn_q", "attn_k")):  # llama.cpp's permute
            heads = c.num_attention_heads if g.endswith("attn_q") else c.num_key_value_heads
            x = x.reshape(heads, 2, x.shape[0] // heads // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)
        if arch in ("gemma2", "gemma3") and "norm" in g:
            x = x + 1
        if g.endswith("ffn_gate_inp_shexp"):
            x = x.reshape(-1)
        _add(w, f"{g}.{suffix}", np.ascontiguousarray(x), quant)
    for key, parts in experts.items():
        _add(w, key, np.stack([parts[e] for e in sorted(parts)]), quant)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return held


def _add(w, name: str, x: np.ndarray, quant: str | None) -> None:  # noqa: ANN001
    if quant and x.ndim >= 2 and x.shape[-1] % 32 == 0 and "norm" not in name:
        w.add_tensor(name, quantize(x.astype(np.float32), T[quant]), raw_dtype=T[quant])
    else:
        w.add_tensor(name, x.astype(np.float32))


def rewrite(src: Path, dst: Path, arch: str | None = None, change=None) -> None:  # noqa: ANN001
    """A copy of a GGUF file with its architecture renamed, or one tensor changed by `change(name, array)`."""
    r = gguf.GGUFReader(src)
    arch = arch or r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(dst, arch)
    old = r.fields["general.architecture"].contents()
    for key, field in r.fields.items():
        if key.startswith(old + "."):
            value = field.contents()
            w.add_key_value(arch + key[len(old):], value, field.types[0] if len(field.types) == 1 else
                            gguf.GGUFValueType.ARRAY, sub_type=field.types[-1] if len(field.types) > 1 else None)
    for t in r.tensors:
        data = np.array(t.data)
        kind = T(t.tensor_type)
        data, kind = change(t.name, data, kind) if change else (data, kind)
        w.add_tensor(t.name, data, raw_dtype=None if kind == T.F32 else kind)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
def reference_tokens(hf, held: dict[str, torch.Tensor], ids: list[int], new: int) -> list[int]:  # noqa: ANN001
    """transformers' greedy tokens on exactly the weights a GGUF file holds (`held`, write_model's answer)."""
    from safetensors.torch import save_file
    import tempfile
    import transformers

    with tempfile.TemporaryDirectory() as d:  # transformers on exactly the weights the file holds
        hf.save_pretrained(d)
        save_file({k: v.contiguous() for k, v in held.items()}, Path(d) / "model.safetensors", metadata={"format": "pt"})
        ref = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ref.config._attn_implementation = "eager"
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    return out[0, len(ids):].tolist()


