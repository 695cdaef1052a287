"""Gemma 3's vision: a SigLIP vision transformer (patch embedding, learned positions, pre-norm encoder layers with
tanh-GELU MLPs, a final LayerNorm) and Gemma 3's multi-modal projector (average-pooled to mm_tokens_per_image
tokens, RMS-normed by (1 + w) in float32, projected to the text model's width), as transformers 5.24's
SiglipVisionModel and Gemma3MultiModalProjector compute them. It computes in float32 whatever the decoder's dtype.

Checkpoint names: `vision_tower.[vision_model.]*` and `multi_modal_projector.*`, with or without the `model.`
prefix (transformers 5 writes them without, the released checkpoints under vision_tower.vision_model)."""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import ModelLoadError
from .checkpoint import assign


class SiglipLayer(nn.Module):
    def __init__(self, hidden: int, intermediate: int, heads: int, eps: float) -> None:
        super().__init__()
        self.heads = heads
        self.layer_norm1 = nn.LayerNorm(hidden, eps=eps)
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(hidden, hidden) for _ in range(3))
        self.out_proj = nn.Linear(hidden, hidden)
        self.layer_norm2 = nn.LayerNorm(hidden, eps=eps)
        self.fc1 = nn.Linear(hidden, intermediate)
        self.fc2 = nn.Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (N, P, C) -> (N, P, C): every patch attends every patch of its image."""
        N, P, C = x.shape
        h = self.layer_norm1(x)
        q, k, v = (p(h).view(N, P, self.heads, C // self.heads).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))  # (N, H, P, D)
        a = F.scaled_dot_product_attention(q, k, v)  # scale D ** -0.5, no mask
        x = x + self.out_proj(a.transpose(1, 2).reshape(N, P, C))
        return x + self.fc2(F.gelu(self.fc1(self.layer_norm2(x)), approximate="tanh"))


class Gemma3Vision(nn.Module):
    """SigLIP + Gemma 3's projector: pixel_values (N, 3, S, S) -> (N * mm_tokens_per_image, text hidden)."""

    bidirectional = True  # transformers' token_type_ids: one image's tokens attend each other during prefill
    prefixes = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")

    def __init__(self, vision: dict[str, Any], text_hidden: int, mm_tokens: int, image_token_id: int) -> None:
        super().__init__()
        hidden, self.patch = int(vision["hidden_size"]), int(vision["patch_size"])
        self.image_size = int(vision["image_size"])
        eps = float(vision.get("layer_norm_eps", 1e-6))
        act = vision.get("hidden_act", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ModelLoadError(f"Gemma 3 vision tower: hidden_act {act!r} is not supported (gelu_pytorch_tanh)")
        self.side = self.image_size // self.patch  # patches per side
        self.patch_embedding = nn.Conv2d(int(vision.get("num_channels", 3)), hidden, self.patch, self.patch)
        self.position_embedding = nn.Embedding(self.side * self.side, hidden)
        self.layers = nn.ModuleList(
            SiglipLayer(hidden, int(vision["intermediate_size"]), int(vision["num_attention_heads"]), eps)
            for _ in range(int(vision["num_hidden_layers"])))
        self.post_layernorm = nn.LayerNorm(hidden, eps=eps)
        per_side = int(mm_tokens**0.5)
        if per_side * per_side != mm_tokens or self.side % per_side:
            raise ModelLoadError(f"Gemma 3: mm_tokens_per_image={mm_tokens} must be a square whose side divides "
                                 f"the {self.side} patches per side")
        self.pool = self.side // per_side
        self.norm_weight = nn.Parameter(torch.zeros(hidden))  # mm_soft_emb_norm: RMSNorm by (1 + w)
        self.norm_eps = eps
        self.projection = nn.Parameter(torch.zeros(hidden, text_hidden))  # mm_input_projection_weight (Cv, Ct)
        self.mm_tokens, self.image_token_id = mm_tokens, image_token_id

    @classmethod
    def from_checkpoint(cls, raw: dict[str, Any], tensors: dict[str, torch.Tensor]) -> "Gemma3Vision":
        vision, text = raw.get("vision_config") or {}, raw.get("text_config") or {}
        image_token = raw.get("image_token_id", raw.get("image_token_index"))
        if not vision or image_token is None:
            raise ModelLoadError("a Gemma3ForConditionalGeneration config.json needs vision_config and "
                                 "image_token_index")
        defaults = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                    "num_attention_heads": 12, "patch_size": 16, "image_size": 224}  # SiglipVisionConfig's
        tower = cls({**defaults, **vision}, int(text.get("hidden_size", 2304)),  # Gemma3TextConfig's
                    int(raw.get("mm_tokens_per_image", 256)), int(image_token))
        state = {_our_name(n): t for n, t in tensors.items()}
        return assign(tower, state, "Gemma 3 vision tower")

    @torch.inference_mode()
    def encode(self, prepared: Any) -> torch.Tensor:
        """prepared.pixel_values (N, 3, S, S) -> (N * mm_tokens_per_image, text hidden) float32, image by image."""
        x = torch.as_tensor(prepared.pixel_values, dtype=torch.float32, device=self.projection.device)
        if x.ndim != 4 or x.shape[2:] != (self.image_size, self.image_size):
            raise ValueError(f"Gemma 3 expects pixel_values (N, 3, {self.image_size}, {self.image_size}), "
                             f"got {tuple(x.shape)}")
        h = self.patch_embedding(x).flatten(2).transpose(1, 2) + self.position_embedding.weight  # (N, P, Cv)
        for layer in self.layers:
            h = layer(h)
        h = self.post_layernorm(h)
        N, P, C = h.shape
        grid = h.transpose(1, 2).reshape(N, C, self.side, self.side)
        pooled = F.avg_pool2d(grid, self.pool, self.pool).flatten(2).transpose(1, 2)  # (N, mm_tokens, Cv)
        normed = pooled * torch.rsqrt(pooled.pow(2).mean(-1, keepdim=True) + self.norm_eps) * (1.0 + self.norm_weight)
        return torch.matmul(normed, self.projection).reshape(N * self.mm_tokens, -1)


_NAMES = (
    (r"^(model\.)?vision_tower\.(vision_model\.)?embeddings\.", ""),
    (r"^(model\.)?vision_tower\.(vision_model\.)?encoder\.layers\.(\d+)\.self_attn\.", r"layers.\3."),
    (r"^(model\.)?vision_tower\.(vision_model\.)?encoder\.layers\.(\d+)\.mlp\.", r"layers.\3."),
    (r"^(model\.)?vision_tower\.(vision_model\.)?encoder\.", ""),
    (r"^(model\.)?vision_tower\.(vision_model\.)?", ""),
    (r"^(model\.)?multi_modal_projector\.mm_soft_emb_norm\.weight$", "norm_weight"),
    (r"^(model\.)?multi_modal_projector\.mm_input_projection_weight$", "projection"),
)


def _our_name(name: str) -> str:
    """A checkpoint tensor's name -> this module's ("vision_tower.encoder.layers.0.mlp.fc1.weight" ->
    "layers.0.fc1.weight")."""
    for pattern, replacement in _NAMES:
        name, n = re.subn(pattern, replacement, name)
        if n:
            return name
    return name
