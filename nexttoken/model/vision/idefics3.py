"""Idefics3's and SmolVLM's vision side: a SigLIP encoder whose position embeddings are looked up by each patch's
fractional place in the image (NaViT's buckets, so any tile size maps onto the trained grid), then the connector:
a pixel shuffle (scale_factor^2 neighbouring patches into one row) and a linear projection to the text model's width.
transformers' modeling_idefics3.py (Idefics3VisionTransformer, Idefics3Connector; SmolVLM's are the same classes).
Weights: `model.vision_model.*`, `model.connector.*`. Computes in float32 unless built in another dtype."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ...errors import ModelLoadError
from .checkpoint import assign

# config.json's hidden_act -> torch's GELU (SigLIP's towers use the tanh approximation)
ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu_fast": "tanh", "gelu": "none"}
PREFIXES = ("model.vision_model.", "model.connector.")


class Embeddings(nn.Module):
    """Patches -> rows: a strided convolution, plus the position embedding of each patch's bucket."""

    def __init__(self, hidden: int, patch: int, image_size: int, channels: int) -> None:
        super().__init__()
        self.patch = patch
        self.side = image_size // patch  # the trained grid's patches per side
        self.patch_embedding = nn.Conv2d(channels, hidden, kernel_size=patch, stride=patch)
        self.position_embedding = nn.Embedding(self.side ** 2, hidden)

    def forward(self, pixels: torch.Tensor, patches: torch.Tensor) -> torch.Tensor:
        """pixels (N, C, H, W), patches (N, h, w) bool (the patches with real pixels) -> (N, h * w, hidden)."""
        x = self.patch_embedding(pixels).flatten(2).transpose(1, 2)  # (N, h * w, hidden)
        return x + self.position_embedding(self.positions(patches))

    def positions(self, patches: torch.Tensor) -> torch.Tensor:
        """(N, h, w) bool -> (N, h * w) position ids: the real patches' fractional coordinates bucketed onto the
        side x side grid (the padding patches take 0), exactly as Idefics3VisionEmbeddings computes them."""
        n, h, w = patches.shape
        boundaries = torch.arange(1 / self.side, 1.0, 1 / self.side, device=patches.device)
        step_h = 1.0 / patches[:, :, 0].sum(dim=1)  # (N,)
        step_w = 1.0 / patches[:, 0, :].sum(dim=1)
        rows = torch.arange(h, device=patches.device, dtype=torch.float32)
        cols = torch.arange(w, device=patches.device, dtype=torch.float32)
        frac_h = (rows[None] * step_h[:, None]).clamp(max=1 - 1e-6)  # (N, h) in [0, 1)
        frac_w = (cols[None] * step_w[:, None]).clamp(max=1 - 1e-6)
        ids = (torch.bucketize(frac_h, boundaries, right=True)[:, :, None] * self.side
               + torch.bucketize(frac_w, boundaries, right=True)[:, None, :])  # (N, h, w)
        return torch.where(patches.reshape(n, -1), ids.reshape(n, -1), 0)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        if hidden % heads:
            raise ModelLoadError(f"vision hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(hidden, hidden) for _ in range(4))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """x (N, L, C), mask (N, 1, 1, L) bool of the keys to attend or None (all) -> (N, L, C)."""
        n, length, c = x.shape
        q, k, v = (p(x).view(n, length, self.heads, -1).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))  # (N, heads, L, head_dim)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (N, heads, L, head_dim), bidirectional
        return self.out_proj(out.transpose(1, 2).reshape(n, length, c))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, approximate: str) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(hidden, intermediate), nn.Linear(intermediate, hidden)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))


class EncoderLayer(nn.Module):
    """SigLIP's pre-norm block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, hidden: int, intermediate: int, heads: int, eps: float, approximate: str) -> None:
        super().__init__()
        self.layer_norm1, self.layer_norm2 = nn.LayerNorm(hidden, eps=eps), nn.LayerNorm(hidden, eps=eps)
        self.self_attn = Attention(hidden, heads)
        self.mlp = MLP(hidden, intermediate, approximate)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), mask)
        return x + self.mlp(self.layer_norm2(x))


class VisionTransformer(nn.Module):
    """Idefics3VisionTransformer: embeddings, the encoder layers, a final LayerNorm."""

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        super().__init__()
        hidden, eps = int(cfg.get("hidden_size", 1152)), float(cfg.get("layer_norm_eps", 1e-6))
        act = cfg.get("hidden_act", "gelu_pytorch_tanh")
        if act not in ACTIVATIONS:
            raise ModelLoadError(f"vision hidden_act {act!r} is not supported; one of {sorted(ACTIVATIONS)}")
        self.patch = int(cfg.get("patch_size", 32))
        self.embeddings = Embeddings(hidden, self.patch, int(cfg.get("image_size", 224)),
                                     int(cfg.get("num_channels", 3)))
        layer = (hidden, int(cfg.get("intermediate_size", 3072)), int(cfg.get("num_attention_heads", 16)), eps,
                 ACTIVATIONS[act])
        self.encoder = nn.ModuleDict({"layers": nn.ModuleList(
            EncoderLayer(*layer) for _ in range(int(cfg.get("num_hidden_layers", 12))))})
        self.post_layernorm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, pixels: torch.Tensor, pixel_mask: torch.Tensor) -> torch.Tensor:
        """pixels (N, C, H, W), pixel_mask (N, H, W) bool -> (N, (H / p) * (W / p), hidden)."""
        n, _, height, width = pixels.shape
        h, w, p = height // self.patch, width // self.patch, self.patch
        patches = pixel_mask[:, :h * p, :w * p].reshape(n, h, p, w, p).any(dim=4).any(dim=2)  # (N, h, w)
        x = self.embeddings(pixels, patches)
        keys = patches.reshape(n, 1, 1, h * w)
        mask = None if bool(keys.all()) else keys  # padding patches are never attended to
        for layer in self.encoder["layers"]:
            x = layer(x, mask)
        return self.post_layernorm(x)


class Connector(nn.Module):
    """Idefics3Connector: the pixel shuffle, then `modality_projection.proj` (no bias) to the text width."""

    def __init__(self, vision_hidden: int, text_hidden: int, scale: int) -> None:
        super().__init__()
        self.scale = scale
        self.modality_projection = nn.Module()
        self.modality_projection.proj = nn.Linear(vision_hidden * scale ** 2, text_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(N, side^2, C) -> (N, side^2 / scale^2, text_hidden)."""
        return self.modality_projection.proj(pixel_shuffle(x, self.scale))


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """(N, side^2, C) -> (N, side^2 / scale^2, C * scale^2): each scale x scale block of the side x side grid of
    rows into one row, in Idefics3Connector.pixel_shuffle's order."""
    n, seq, c = x.shape
    side = int(seq ** 0.5)
    x = x.view(n, side, side // scale, c * scale)  # (N, h, w / s, C s): s neighbours along a row
    x = x.permute(0, 2, 1, 3).reshape(n, side // scale, side // scale, c * scale ** 2)  # then s along a column
    return x.permute(0, 2, 1, 3).reshape(n, seq // scale ** 2, c * scale ** 2)


class Idefics3Vision(nn.Module):
    """The tower and connector of an Idefics3ForConditionalGeneration / SmolVLMForConditionalGeneration checkpoint."""

    bidirectional = False  # the text model stays causal over the image's tokens
    prefixes = PREFIXES

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        vision, text = config.get("vision_config") or {}, config.get("text_config") or {}
        self.image_token_id = int(config.get("image_token_id", 128257))
        self.vision_model = VisionTransformer(vision)
        self.connector = Connector(int(vision.get("hidden_size", 1152)), int(text.get("hidden_size", 4096)),
                                   int(config.get("scale_factor", 2)))

    @classmethod
    def from_checkpoint(cls, raw: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> "Idefics3Vision":
        """The tower of a checkpoint's config.json and tensors (model/vision/__init__.py's interface)."""
        if not raw.get("vision_config"):
            raise ModelLoadError(f"an {raw.get('architectures', ['Idefics3'])[0]} config.json needs vision_config")
        return cls(raw).load(tensors)

    def load(self, tensors: Mapping[str, torch.Tensor]) -> "Idefics3Vision":
        """Copy the checkpoint's `model.vision_model.*` and `model.connector.*` tensors in (every one required)."""
        state = {name.removeprefix("model."): t for name, t in tensors.items() if name.startswith(PREFIXES)}
        return assign(self, state, "the Idefics3 vision tower", extra_ok=False)

    @torch.inference_mode()
    def encode(self, prepared: Any) -> torch.Tensor:
        """Prepared (images/idefics3.py) -> (sum(prepared.tokens), text_hidden): each tile's rows, in prompt order."""
        p = next(self.parameters())
        pixels = torch.from_numpy(np.ascontiguousarray(prepared.pixel_values)).to(p.device, p.dtype)
        mask = torch.from_numpy(np.asarray(prepared.extra["pixel_attention_mask"], dtype=bool)).to(p.device)
        return self.connector(self.vision_model(pixels, mask)).flatten(0, 1)
