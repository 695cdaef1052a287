"""Checkpoints that stack each projection's experts in one tensor (gpt-oss), unstacked into the per-expert names
loader.py reads (families/base.py's Family.stacked_experts).

gpt-oss stores, per layer, under model.layers.{i}.mlp.:
- experts.gate_up_proj (E, C, 2I): x @ W, gate and up interleaved along the last dim (gate = even columns);
  experts.gate_up_proj_bias (E, 2I), likewise interleaved;
- experts.down_proj (E, I, C), experts.down_proj_bias (E, C);
- or, in the released checkpoints, each matrix as MXFP4: `<name>_blocks` (E, out, K/32, 16) uint8, two E2M1
  values a byte (low nibble first), and `<name>_scales` (E, out, K/32) uint8 E8M0 exponents (value * 2^(s - 127)),
  rows of outputs (not transposed); transformers' integrations/mxfp4.py `convert_moe_packed_tensors` reads them so;
- router.weight (E, C), router.bias (E,); self_attn.sinks (H,).
They become mlp.experts.{e}.{gate,up,down}_proj.{weight,bias}, mlp.gate.{weight,bias} and self_attn.sinks.weight
(llama.cpp's names, so a GGUF file of the same model maps onto the same names).

Granite 4.0-H with experts stores, per layer, block_sparse_moe.input_linear (E, 2I, C): each expert's [gate; up]
rows; block_sparse_moe.output_linear (E, C, I); block_sparse_moe.router.layer (E, C); and the shared MLP as
shared_mlp.input_linear (2S, C) = [gate; up], shared_mlp.output_linear (C, S). They become
block_sparse_moe.experts.{e}.{gate,up,down}_proj.weight, block_sparse_moe.gate.weight and
block_sparse_moe.shared_expert.{gate,up,down}_proj.weight (the family's renames take block_sparse_moe to mlp).
"""

from __future__ import annotations

import torch

from ...config import ModelConfig
from ...errors import ModelLoadError

# E2M1 values of the 16 codes (sign, 2-bit exponent, 1-bit mantissa): the OCP MX spec's FP4.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(..., G, 16) uint8 blocks and (..., G) uint8 scales -> (..., G * 32) float32, exactly (every value is a
    power of two times an E2M1 value: no rounding)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape \
            or blocks.shape[-1] != 16:
        raise ModelLoadError(f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales {tuple(scales.shape)} "
                             f"{scales.dtype} do not fit (blocks (..., G, 16) uint8, scales (..., G) uint8)")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    out = torch.empty(*blocks.shape[:-1], 32, dtype=torch.float32)  # (..., G, 32)
    out[..., 0::2] = lut[(blocks & 0x0F).long()]
    out[..., 1::2] = lut[(blocks >> 4).long()]
    out = torch.ldexp(out, scales.to(torch.int32)[..., None] - 127)
    return out.reshape(*blocks.shape[:-2], -1)


def mxfp4_to_ggml(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The checkpoint's MXFP4 (..., G, 16) blocks + (..., G) scales as ggml's MXFP4 rows (..., G * 17) uint8: each
    block its scale byte then 16 bytes whose low nibbles are values 0-15 and high nibbles values 16-31 (ggml-common.h's
    block_mxfp4; llama.cpp's converter repacks the same way)."""
    lo, hi = blocks & 0x0F, blocks >> 4  # values 2j and 2j + 1
    values = torch.stack((lo, hi), dim=-1).reshape(*blocks.shape[:-1], 32)  # (..., G, 32) codes in order
    qs = values[..., :16] | (values[..., 16:] << 4)
    return torch.cat((scales[..., None], qs), dim=-1).reshape(*blocks.shape[:-2], -1).contiguous()


def packed_experts(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The MXFP4 experts kept as stored: each expert projection's checkpoint name (loader.py's) -> its rows as
    ggml's MXFP4 blocks (out, K / 32 * 17) uint8 (quant/mxfp4.py's Mxfp4Linear reads them), for every stacked
    matrix the checkpoint holds as `*_blocks` / `*_scales`; their entries are taken out of `tensors`."""
    moe = cfg.moe
    assert moe is not None
    kept: dict[str, torch.Tensor] = {}
    for i in range(cfg.num_hidden_layers):
        x = f"model.layers.{i}.mlp.experts."
        for name, parts in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
            blocks, scales = tensors.get(x + name + "_blocks"), tensors.get(x + name + "_scales")
            if blocks is None or scales is None:
                continue
            rows = mxfp4_to_ggml(tensors.pop(x + name + "_blocks"), tensors.pop(x + name + "_scales"))  # (E, N, .)
            for e in range(moe.num_experts):
                for j, part in enumerate(parts):  # gate / up interleaved: even / odd rows
                    kept[f"{x}{e}.{part}.weight"] = rows[e, j :: len(parts)]
    return kept


def unstack(cfg: ModelConfig, tensors: dict[str, torch.Tensor], source: object) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under loader.py's names (see the module docstring); other tensors as they are."""
    moe = cfg.moe
    assert moe is not None
    out = dict(tensors)
    E = moe.num_experts
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        if p + "self_attn.sinks" in out:
            out[p + "self_attn.sinks.weight"] = out.pop(p + "self_attn.sinks")
        for kind in ("weight", "bias"):
            if p + f"mlp.router.{kind}" in out:
                out[p + f"mlp.gate.{kind}"] = out.pop(p + f"mlp.router.{kind}")
        _granite_layer(out, p, E)
        x = p + "mlp.experts."
        gate_up, down = _matrix(out, x + "gate_up_proj", source), _matrix(out, x + "down_proj", source)
        gate_up_bias, down_bias = out.pop(x + "gate_up_proj_bias", None), out.pop(x + "down_proj_bias", None)
        for e in range(E):
            if gate_up is not None:  # (2I, C) rows of outputs, gate and up interleaved
                out[f"{x}{e}.gate_proj.weight"], out[f"{x}{e}.up_proj.weight"] = gate_up[e, 0::2], gate_up[e, 1::2]
            if down is not None:
                out[f"{x}{e}.down_proj.weight"] = down[e]  # (C, I)
            if gate_up_bias is not None:
                out[f"{x}{e}.gate_proj.bias"], out[f"{x}{e}.up_proj.bias"] = gate_up_bias[e, 0::2], gate_up_bias[e, 1::2]
            if down_bias is not None:
                out[f"{x}{e}.down_proj.bias"] = down_bias[e]
    return out


def _granite_layer(t: dict[str, torch.Tensor], p: str, experts: int) -> None:
    """Granite 4.0-H's stacked experts and shared MLP of the layer under prefix p, per expert (module docstring);
    nothing where the layer has none."""
    x = p + "block_sparse_moe."
    gate_up, down = t.pop(x + "input_linear.weight", None), t.pop(x + "output_linear.weight", None)
    if gate_up is None or down is None:
        return
    half = gate_up.shape[1] // 2
    for e in range(experts):
        t[f"{x}experts.{e}.gate_proj.weight"], t[f"{x}experts.{e}.up_proj.weight"] = gate_up[e, :half], gate_up[e, half:]
        t[f"{x}experts.{e}.down_proj.weight"] = down[e]  # (C, I)
    if x + "router.layer.weight" in t:
        t[x + "gate.weight"] = t.pop(x + "router.layer.weight")
    shared = t.pop(p + "shared_mlp.input_linear.weight", None)
    if shared is not None:
        s = shared.shape[0] // 2
        t[x + "shared_expert.gate_proj.weight"], t[x + "shared_expert.up_proj.weight"] = shared[:s], shared[s:]
        t[x + "shared_expert.down_proj.weight"] = t.pop(p + "shared_mlp.output_linear.weight")


def _matrix(t: dict[str, torch.Tensor], name: str, source: object) -> torch.Tensor | None:
    """A stacked projection as (E, out, in) rows of outputs: MXFP4 blocks dequantized, a float tensor transposed
    from the checkpoint's x @ W layout; None where the checkpoint has neither."""
    if name + "_blocks" in t or name + "_scales" in t:
        blocks, scales = t.pop(name + "_blocks", None), t.pop(name + "_scales", None)
        if blocks is None or scales is None:
            raise ModelLoadError(f"{source}: {name} has MXFP4 {'scales' if blocks is None else 'blocks'} but no "
                                 f"{'blocks' if blocks is None else 'scales'}; the checkpoint is incomplete")
        return dequantize_mxfp4(blocks, scales)
    w = t.pop(name, None)
    return None if w is None else w.transpose(1, 2).contiguous()  # contiguous rows: the native kernels read them
