"""Tiny random-weight gpt-oss checkpoints (transformers' GptOssForCausalLM) for parity tests: several layers,
sliding layers whose window (4) is shorter than the tests' sequences (sinks and the window past its length), 4
experts with top 2, YaRN whose ramp covers some of the frequencies, biases and sinks drawn (transformers
initialises them to zero), and the MXFP4 form of the released checkpoints (`*_blocks` / `*_scales`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

CONFIG = dict(
    vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=128, sliding_window=4, num_local_experts=4,
    num_experts_per_tok=2, initializer_range=0.3, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    tie_word_embeddings=False, swiglu_limit=7.0,
    rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0,
                         truncate=False, original_max_position_embeddings=32),
)


def build(seed: int = 0, **overrides):  # noqa: ANN201
    """A GptOssForCausalLM of CONFIG (with overrides), eager attention and experts (transformers' own loops)."""
    import transformers

    cfg = transformers.GptOssConfig(**{**CONFIG, **overrides})
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias", "sinks")):  # zero at init; make them matter
                p.normal_(0, 0.5)
    return model


def save(directory: Path, seed: int = 0, **overrides):  # noqa: ANN201
    model = build(seed, **overrides)
    model.save_pretrained(directory)
    return model


def quantize_mxfp4(model, directory: Path) -> None:  # noqa: ANN001
    """Round every expert matrix of `model` to MXFP4 (in place: the model then holds the dequantized values) and
    write the folder as the released checkpoints are: the experts as `*_blocks` / `*_scales` (transformers'
    layout: rows of outputs, low nibble first) and config.json's quantization_config {"quant_method": "mxfp4"}."""
    from gguf.quants import quantize as gguf_quantize, dequantize as gguf_dequantize
    from gguf import GGMLQuantizationType
    from safetensors.torch import save_file

    model.save_pretrained(directory)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        rows = state.pop(name).transpose(1, 2).contiguous()  # (E, out, in)
        E, N, K = rows.shape
        packed = gguf_quantize(rows.reshape(-1, K).numpy(), GGMLQuantizationType.MXFP4)  # ggml blocks of 17 bytes
        packed = torch.from_numpy(packed.reshape(E, N, K // 32, 17))
        scales, qs = packed[..., 0], packed[..., 1:]
        # ggml's block: low nibbles are values 0-15, high nibbles 16-31; the checkpoint's: byte j holds 2j, 2j + 1
        codes = torch.cat((qs & 0x0F, qs >> 4), dim=-1)  # (E, N, G, 32) codes in order
        blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
        state[name + "_blocks"], state[name + "_scales"] = blocks.contiguous(), scales.contiguous()
        values = gguf_dequantize(packed.reshape(-1, K // 32 * 17).numpy(), GGMLQuantizationType.MXFP4)
        with torch.no_grad():
            model.get_parameter(name).copy_(torch.from_numpy(values).reshape(E, N, K).transpose(1, 2))
    for f in directory.glob("*.safetensors"):
        f.unlink()
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((directory / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
