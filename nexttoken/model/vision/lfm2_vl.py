"""LFM2-VL's vision side (Liquid AI): a SigLIP2 NaFlex tower (each image at its own patch grid: patches embedded by a
linear layer, the learned square grid of position embeddings resized to the image's grid by an antialiased
bilinear interpolation, padding patches masked out of attention) and the projector: a pixel unshuffle (each
downsample_factor^2 block of patches into one row), a LayerNorm, a GELU MLP to the text model's width.
transformers' modeling_siglip2.py (Siglip2VisionModel without its head) and modeling_lfm2_vl.py
(Lfm2VlModel.get_image_features, Lfm2VlMultiModalProjector). Weights: `model.vision_tower.[vision_model.]*` and
`model.multi_modal_projector.*`. Computes in float32.
Its inputs (patchified tiles, their masks and spatial shapes) are images/lfm2_vl.py's."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ...errors import ModelLoadError
from .checkpoint import assign
from .idefics3 import ACTIVATIONS, EncoderLayer

PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.")


def resized_positions(grid: torch.Tensor, shapes: torch.Tensor, length: int) -> torch.Tensor:
    """grid (G, G, C) position embeddings, shapes (N, 2) patch rows and columns -> (N, length, C): each image's
    grid resized to its rows x columns as F.interpolate(mode="bilinear", antialias=True) resizes it, row-major,
    the padding positions taking the first one's (Siglip2VisionEmbeddings.resize_positional_embeddings)."""
    size = grid.shape[0]
    sizes = shapes.float()[:, None]  # (N, 1, 2)
    positions = torch.arange(length, dtype=torch.float32, device=grid.device)[None, :, None]  # (1, L, 1)
    rows = torch.div(positions, sizes[..., 1:], rounding_mode="floor")
    index = torch.cat([rows, positions - rows * sizes[..., 1:]], dim=-1)  # (N, L, 2): each position's row, column
    index = index * (positions < sizes.prod(-1, keepdim=True))
    scale = size / sizes
    support = scale.clamp(min=1)
    center = (index + 0.5) * scale - 0.5
    source = torch.arange(size, dtype=torch.float32, device=grid.device)
    weights = (1 - (source - center[..., None]).abs().div(support[..., None])).clamp(min=0)  # (N, L, 2, G)
    weights = weights / weights.sum(-1, keepdim=True)
    weights = (weights[..., 0, :, None] * weights[..., 1, None, :]).flatten(-2)  # (N, L, G * G)
    return weights @ grid.reshape(-1, grid.shape[-1]).float()


class Siglip2Tower(nn.Module):
    """Siglip2VisionModel without the pooling head: embeddings, the SigLIP layers, the final LayerNorm."""

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        super().__init__()
        hidden, eps = int(cfg.get("hidden_size", 768)), float(cfg.get("layer_norm_eps", 1e-6))
        p = int(cfg.get("patch_size", 16))
        act = cfg.get("hidden_act", "gelu_pytorch_tanh")
        if act not in ACTIVATIONS:
            raise ModelLoadError(f"vision hidden_act {act!r} is not supported; one of {sorted(ACTIVATIONS)}")
        self.embeddings = nn.Module()
        self.embeddings.patch_embedding = nn.Linear(int(cfg.get("num_channels", 3)) * p * p, hidden)
        self.embeddings.position_embedding = nn.Embedding(int(cfg.get("num_patches", 256)), hidden)
        self.side = int(int(cfg.get("num_patches", 256)) ** 0.5)
        layer = (hidden, int(cfg.get("intermediate_size", 3072)), int(cfg.get("num_attention_heads", 12)), eps,
                 ACTIVATIONS[act])
        self.encoder = nn.ModuleDict({"layers": nn.ModuleList(
            EncoderLayer(*layer) for _ in range(int(cfg.get("num_hidden_layers", 12))))})
        self.post_layernorm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, pixels: torch.Tensor, mask: torch.Tensor, shapes: torch.Tensor) -> torch.Tensor:
        """pixels (N, L, C p p) patchified, mask (N, L) bool of the real patches, shapes (N, 2) -> (N, L, hidden)."""
        grid = self.embeddings.position_embedding.weight.reshape(self.side, self.side, -1)
        x = self.embeddings.patch_embedding(pixels) + resized_positions(grid, shapes, pixels.shape[1])
        keys = None if bool(mask.all()) else mask[:, None, None, :]  # (N, 1, 1, L): padding never attended to
        for layer in self.encoder["layers"]:
            x = layer(x, keys)
        return self.post_layernorm(x)


class Projector(nn.Module):
    """Lfm2VlMultiModalProjector: pixel unshuffle, LayerNorm, linear, GELU, linear."""

    def __init__(self, config: Mapping[str, Any], vision_hidden: int, text_hidden: int) -> None:
        super().__init__()
        self.factor = int(config.get("downsample_factor", 2))
        width, bias = vision_hidden * self.factor ** 2, bool(config.get("projector_bias", True))
        self.layer_norm = nn.LayerNorm(width) if config.get("projector_use_layernorm", True) else None
        self.linear_1 = nn.Linear(width, int(config.get("projector_hidden_size", 2560)), bias=bias)
        self.linear_2 = nn.Linear(int(config.get("projector_hidden_size", 2560)), text_hidden, bias=bias)
        act = config.get("projector_hidden_act", "gelu")
        if act not in ACTIVATIONS:
            raise ModelLoadError(f"projector_hidden_act {act!r} is not supported; one of {sorted(ACTIVATIONS)}")
        self.approximate = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, W, H, C) -> (B, H / f, W / f, text hidden), as the transformers projector's pixel_unshuffle."""
        b, w, h, c = x.shape
        f = self.factor
        x = x.reshape(b, w, h // f, c * f).permute(0, 2, 1, 3).reshape(b, h // f, w // f, c * f * f).permute(0, 2, 1, 3)
        if self.layer_norm is not None:
            x = self.layer_norm(x)
        return self.linear_2(F.gelu(self.linear_1(x), approximate=self.approximate))


class Lfm2VlVision(nn.Module):
    """The tower and projector of an Lfm2VlForConditionalGeneration checkpoint."""

    bidirectional = False
    prefixes = PREFIXES

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        vision, text = config.get("vision_config") or {}, config.get("text_config") or {}
        self.image_token_id = int(config.get("image_token_id", 396))
        self.vision_tower = Siglip2Tower(vision)
        self.multi_modal_projector = Projector(config, int(vision.get("hidden_size", 768)),
                                               int(text.get("hidden_size", 1024)))

    @classmethod
    def from_checkpoint(cls, raw: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> "Lfm2VlVision":
        if not raw.get("vision_config"):
            raise ModelLoadError("an Lfm2VlForConditionalGeneration config.json needs vision_config")
        return cls(raw).load(tensors)

    def load(self, tensors: Mapping[str, torch.Tensor]) -> "Lfm2VlVision":
        """Copy the checkpoint's `model.vision_tower.[vision_model.]*` and `model.multi_modal_projector.*` in."""
        state = {re.sub(r"^vision_tower\.vision_model\.", "vision_tower.", name.removeprefix("model.")): t
                 for name, t in tensors.items() if name.startswith(PREFIXES)}
        return assign(self, state, "the LFM2-VL vision tower", extra_ok=False)

    @torch.inference_mode()
    def encode(self, prepared: Any) -> torch.Tensor:
        """Prepared (pixel_values (N, L, 3 p p) patchified; extra: pixel_attention_mask (N, L), spatial_shapes
        (N, 2)) -> (sum of each tile's (rows / f) * (cols / f), text hidden), tile after tile."""
        p = next(self.parameters())
        pixels = torch.from_numpy(np.ascontiguousarray(prepared.pixel_values)).to(p.device, p.dtype)
        mask = torch.from_numpy(np.asarray(prepared.extra["pixel_attention_mask"], dtype=bool)).to(p.device)
        shapes = torch.from_numpy(np.asarray(prepared.extra["spatial_shapes"], dtype=np.int64)).to(p.device)
        return self.features(self.vision_tower(pixels, mask, shapes), shapes)

    def features(self, hidden: torch.Tensor, shapes: torch.Tensor) -> torch.Tensor:
        """(N, L, C) tower rows -> the projected tokens of every tile's real patches, gathered into
        downsample_factor^2 blocks exactly as Lfm2VlModel.get_image_features gathers them."""
        n, length, _ = hidden.shape
        f = self.multi_modal_projector.factor
        widths = shapes[:, 1, None]
        per_row = widths // f
        count = (shapes[:, 0, None] // f) * per_row  # (N, 1) tokens of each tile
        token = torch.arange(length // f ** 2, device=hidden.device)[None]
        offset = torch.arange(f, device=hidden.device)
        rows = (token // per_row * f)[..., None, None] + offset[:, None]
        cols = (token % per_row * f)[..., None, None] + offset
        first = torch.arange(n, device=hidden.device)[:, None, None, None] * length  # each tile's first row
        index = first + rows * widths[..., None, None] + cols
        real = token < count
        index = index.masked_fill(~real[..., None, None], 0).flatten(0, 1).permute(1, 0, 2).reshape(f, -1)
        out = self.multi_modal_projector(hidden.reshape(-1, hidden.shape[-1])[index].unsqueeze(0))
        return out.reshape(-1, out.shape[-1])[real.flatten()]
