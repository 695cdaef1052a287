"""Gemma 4's vision: transformers 5.24's Gemma4VisionModel and Gemma4MultimodalEmbedder (modeling_gemma4.py), in
float32 whatever the decoder's dtype.

- Patch embedder: the pixels mapped from [0, 1] to [-1, 1], a bias-free projection, plus a learned x and a learned
  y embedding per patch (zero on padding patches).
- Encoder layers: Gemma's sandwich-normed block (RMSNorm scaling by `w`), attention with q / k RMS-normed per head,
  values RMS-normed without a scale, scale 1, 2-D axial RoPE (the head's first half rotates by x, the second by y,
  each half as rotate-half RoPE), every real patch attending every real patch of its image; a GeGLU MLP. Linears
  optionally clip their inputs and outputs (`use_clipped_linears`).
- Pooler: padding zeroed, each pooling_kernel_size^2 square of patches averaged (one-hot weights, as transformers),
  x sqrt(hidden), padding rows dropped, optionally standardised (`standardize`: std_bias / std_scale).
- Embedder: RMSNorm without a scale, then a bias-free projection to the text model's width.

Image tokens attend causally in the decoder unless text_config.use_bidirectional_attention is "vision": then, during
the prefill, an image's tokens attend each other both ways on the sliding layers (the full layers stay causal):
`bidirectional` "sliding", which the engine reads.

Checkpoint names: `model.vision_tower.*` and `model.embed_vision.*` (or without `model.`)."""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import ModelLoadError
from .checkpoint import assign

DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 16, "num_attention_heads": 12,
            "num_key_value_heads": 12, "head_dim": 64, "rms_norm_eps": 1e-6, "pooling_kernel_size": 3,
            "patch_size": 16, "position_embedding_size": 10240, "use_clipped_linears": False, "standardize": False,
            "hidden_activation": "gelu_pytorch_tanh"}  # transformers' Gemma4VisionConfig


def rms(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Gemma4RMSNorm in float32: x * (mean(x^2) + eps)^-0.5 [* weight]."""
    y = x.float() * torch.pow(x.float().pow(2).mean(-1, keepdim=True) + eps, -0.5)
    return y if weight is None else y * weight.float()


class Norm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms(x, self.eps, self.weight)


class ClippableLinear(nn.Module):
    """A bias-free linear whose input and output are clamped to stored bounds when the checkpoint has them."""

    def __init__(self, fan_in: int, fan_out: int, clipped: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(fan_in, fan_out, bias=False)
        self.clipped = clipped
        if clipped:
            for name in ("input_min", "input_max", "output_min", "output_max"):
                self.register_buffer(name, torch.tensor(float("inf") if name.endswith("max") else -float("inf")))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.clipped:
            return self.linear(x)
        return torch.clamp(self.linear(torch.clamp(x, self.input_min, self.input_max)), self.output_min,
                           self.output_max)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (N, P, H, D), cos / sin (N, P, D): the head's halves rotated by x then y, rotate-half within each."""
    out = []
    for part, c, s in zip(x.chunk(2, dim=-1), cos.chunk(2, dim=-1), sin.chunk(2, dim=-1)):
        a, b = part.chunk(2, dim=-1)
        out.append(part * c[:, :, None] + torch.cat((-b, a), dim=-1) * s[:, :, None])
    return torch.cat(out, dim=-1)


class Layer(nn.Module):
    def __init__(self, v: dict[str, Any]) -> None:
        super().__init__()
        C, I, clip = int(v["hidden_size"]), int(v["intermediate_size"]), bool(v["use_clipped_linears"])
        self.heads, self.kv_heads, self.head_dim = (int(v["num_attention_heads"]), int(v["num_key_value_heads"]),
                                                    int(v["head_dim"]))
        self.eps = float(v["rms_norm_eps"])
        D = self.head_dim
        self.q_proj = ClippableLinear(C, self.heads * D, clip)
        self.k_proj = ClippableLinear(C, self.kv_heads * D, clip)
        self.v_proj = ClippableLinear(C, self.kv_heads * D, clip)
        self.o_proj = ClippableLinear(self.heads * D, C, clip)
        self.q_norm, self.k_norm = Norm(D, self.eps), Norm(D, self.eps)
        self.gate_proj, self.up_proj = ClippableLinear(C, I, clip), ClippableLinear(C, I, clip)
        self.down_proj = ClippableLinear(I, C, clip)
        self.input_layernorm, self.post_attention_layernorm = Norm(C, self.eps), Norm(C, self.eps)
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = Norm(C, self.eps), Norm(C, self.eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """x (N, P, C), keep (N, 1, 1, P) bool: the real patches every patch may attend -> (N, P, C)."""
        N, P, _ = x.shape
        h = self.input_layernorm(x)
        q = rotate(self.q_norm(self.q_proj(h).view(N, P, -1, self.head_dim)), cos, sin).transpose(1, 2)
        k = rotate(self.k_norm(self.k_proj(h).view(N, P, -1, self.head_dim)), cos, sin).transpose(1, 2)
        v = rms(self.v_proj(h).view(N, P, -1, self.head_dim), self.eps).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=1.0,
                                           enable_gqa=self.heads != self.kv_heads)  # (N, H, P, D)
        x = x + self.post_attention_layernorm(self.o_proj(a.transpose(1, 2).reshape(N, P, -1)))
        h = self.pre_feedforward_layernorm(x)
        h = self.down_proj(F.gelu(self.gate_proj(h), approximate="tanh") * self.up_proj(h))
        return x + self.post_feedforward_layernorm(h)


class Gemma4Vision(nn.Module):
    """Gemma4VisionModel + embed_vision: pixel_values (N, max_patches, patch^2 x 3) and image_position_ids
    (N, max_patches, 2) -> (soft tokens of all images, text hidden)."""

    prefixes = ("vision_tower.", "embed_vision.", "model.vision_tower.", "model.embed_vision.")

    def __init__(self, vision: dict[str, Any], text_hidden: int, image_token_id: int,
                 bidirectional: bool = False) -> None:
        super().__init__()
        v = {**DEFAULTS, **vision}
        if v["hidden_activation"] != "gelu_pytorch_tanh":
            raise ModelLoadError(f"Gemma 4 vision tower: hidden_activation {v['hidden_activation']!r} is not "
                                 "supported (gelu_pytorch_tanh)")
        rope = v.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ModelLoadError(f"Gemma 4 vision tower: rope_type {rope.get('rope_type')!r} (axial only)")
        C, self.patch, self.kernel = int(v["hidden_size"]), int(v["patch_size"]), int(v["pooling_kernel_size"])
        self.eps = float(v["rms_norm_eps"])
        self.input_proj = nn.Linear(3 * self.patch**2, C, bias=False)
        self.position_embedding_table = nn.Parameter(torch.ones(2, int(v["position_embedding_size"]), C))
        self.layers = nn.ModuleList(Layer(v) for _ in range(int(v["num_hidden_layers"])))
        spatial = int(v["head_dim"]) // 2
        inv = 1.0 / (float(rope.get("rope_theta", 100.0)) ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))
        self.register_buffer("inv_freq", inv, persistent=False)
        self.standardize = bool(v["standardize"])
        if self.standardize:
            self.register_buffer("std_bias", torch.zeros(C))
            self.register_buffer("std_scale", torch.ones(C))
        self.projection = nn.Linear(int(v.get("output_proj_dims") or C), text_hidden, bias=False)
        self.image_token_id = image_token_id
        # text_config.use_bidirectional_attention "vision": an image's tokens attend each other both ways during the
        # prefill on the sliding layers only (transformers' create_masks_for_vision_model); otherwise causally
        self.bidirectional: bool | str = "sliding" if bidirectional else False

    @classmethod
    def from_checkpoint(cls, raw: dict[str, Any], tensors: dict[str, torch.Tensor]) -> "Gemma4Vision":
        vision, text = raw.get("vision_config") or {}, raw.get("text_config") or {}
        if not vision:
            raise ModelLoadError("a Gemma4ForConditionalGeneration config.json needs vision_config to take images")
        tower = cls(vision, int(text.get("hidden_size", 2304)), int(raw.get("image_token_id", 258880)),
                    text.get("use_bidirectional_attention") == "vision")
        state = {_our_name(n): t for n, t in tensors.items()}
        return assign(tower, state, "Gemma 4 vision tower")

    @torch.inference_mode()
    def encode(self, prepared: Any) -> torch.Tensor:
        """prepared.pixel_values (N, P, patch^2 x 3), extra image_position_ids (N, P, 2) -> (sum of the images'
        soft tokens, text hidden) float32, in image order."""
        device = self.input_proj.weight.device
        x = torch.as_tensor(prepared.pixel_values, dtype=torch.float32, device=device)
        pos = torch.as_tensor(prepared.extra["image_position_ids"], dtype=torch.long, device=device)
        if x.ndim != 3 or x.shape[-1] != 3 * self.patch**2 or pos.shape != (*x.shape[:2], 2):
            raise ValueError(f"Gemma 4 expects pixel_values (N, P, {3 * self.patch**2}) and image_position_ids "
                             f"(N, P, 2), got {tuple(x.shape)} and {tuple(pos.shape)}")
        pad = (pos == -1).all(dim=-1)  # (N, P)
        at = pos.clamp(min=0)
        table = self.position_embedding_table
        where = F.embedding(at[..., 0], table[0]) + F.embedding(at[..., 1], table[1])
        h = self.input_proj(2 * (x - 0.5)) + torch.where(pad[..., None], 0.0, where)  # (N, P, C)
        freqs = at.float()[..., None] * self.inv_freq  # (N, P, 2, D/4): x's then y's frequencies
        angles = torch.cat([freqs[:, :, 0], freqs[:, :, 0], freqs[:, :, 1], freqs[:, :, 1]], dim=-1)  # (N, P, D)
        cos, sin = angles.cos(), angles.sin()
        keep = ~pad[:, None, None, :]
        for layer in self.layers:
            h = layer(h, cos, sin, keep)
        pooled, real = self._pool(h.masked_fill(pad[..., None], 0.0), at, pad, x.shape[1] // self.kernel**2)
        rows = (pooled.float() * h.shape[-1] ** 0.5)[real]  # (soft tokens, C)
        if self.standardize:
            rows = (rows - self.std_bias) * self.std_scale
        return self.projection(rms(rows, self.eps))

    def _pool(self, h: torch.Tensor, at: torch.Tensor, pad: torch.Tensor,
              length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """h (N, P, C) -> (N, length, C) each k x k square of patches averaged (one-hot weights / k^2, as
        transformers' _avg_pool_by_positions) and (N, length) which outputs any patch reached."""
        if h.shape[1] == length:  # no pooling (k = 1): the real patches are the rows
            return h, ~pad
        k = int((h.shape[1] // length) ** 0.5)
        width = at[..., 0].max(dim=-1, keepdim=True)[0] + 1  # (N, 1) the image's patches per row
        cell = torch.div(at, k, rounding_mode="floor")
        index = cell[..., 0] + (width // k) * cell[..., 1]  # (N, P) the output row each patch averages into
        weights = F.one_hot(index, length).float() / k**2  # (N, P, length)
        return weights.transpose(1, 2) @ h.float(), ~(weights == 0).all(dim=1)


_NAMES = (
    (r"^(model\.)?vision_tower\.patch_embedder\.", ""),
    (r"^(model\.)?vision_tower\.encoder\.layers\.(\d+)\.(self_attn|mlp)\.", r"layers.\2."),
    (r"^(model\.)?vision_tower\.encoder\.", ""),
    (r"^(model\.)?vision_tower\.", ""),
    (r"^(model\.)?embed_vision\.embedding_projection\.", "projection."),
)


def _our_name(name: str) -> str:
    """A checkpoint tensor's name -> this module's ("model.vision_tower.encoder.layers.0.mlp.up_proj.linear.weight"
    -> "layers.0.up_proj.linear.weight")."""
    for pattern, replacement in _NAMES:
        name, n = re.subn(pattern, replacement, name)
        if n:
            return name
    return name
