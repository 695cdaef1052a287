"""Qwen2.5-VL's vision tower: a ViT over 14 x 14 (x 2 frames) patches with 2-D rotary positions, attention within
windows of window_size pixels except at fullatt_block_indexes (whole image), and the patch merger that joins each
merge x merge block of patches into one token of the text model's width. transformers' modeling_qwen2_5_vl.py
(Qwen2_5_VisionTransformerPretrainedModel) and vision_utils.py, step by step, in float32 by default.

The patches arrive merge block by merge block (images/qwen_vl.py's layout). The windows reorder those blocks so each
window's blocks are consecutive (`window_index`); the merger's output is put back in the image's order.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import ModelLoadError
from ..rope import mrope_index
from .checkpoint import assign

ACTIVATIONS = MappingProxyType({
    "silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x)})
# Where a checkpoint keeps the tower: Qwen2.5-VL's files `visual.*`, Qwen3-VL's (transformers 5) `model.visual.*`.
PREFIXES = ("visual.", "model.visual.")


def tower_state(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Qwen-VL checkpoint's `visual.*` / `model.visual.*` tensors under the tower's own names."""
    state = {}
    for name, tensor in tensors.items():
        prefix = next((p for p in PREFIXES if name.startswith(p)), None)
        if prefix is not None:
            state[name[len(prefix):].replace("patch_embed.proj.", "patch_embed.")] = tensor
    return state


def activation(name: str):  # noqa: ANN201
    if name not in ACTIVATIONS:
        raise ModelLoadError(f"Qwen-VL vision tower: hidden_act {name!r} is not supported ({', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]


@dataclass(frozen=True)
class QwenVisionConfig:
    """config.json's `vision_config` (Qwen2_5_VLVisionConfig's fields and defaults)."""

    depth: int = 32
    hidden_size: int = 3584
    intermediate_size: int = 3420
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    out_hidden_size: int = 3584
    hidden_act: str = "silu"
    rope_theta: float = 10000.0

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "QwenVisionConfig":
        rope = raw.get("rope_parameters") or {}
        known = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw and k != "rope_theta"}
        known["fullatt_block_indexes"] = tuple(known.get("fullatt_block_indexes", cls.fullatt_block_indexes))
        return cls(**known, rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))))

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class MLP(nn.Module):
    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (N, H, D) rotated in float32 by cos / sin (N, D), transformers' rotate_half layout."""
    half = x.shape[-1] // 2
    xf = x.float()
    turned = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos[:, None] + turned * sin[:, None]).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        self.heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, cfg.hidden_size * 3)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, lengths: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (N, C): attention within each run of `lengths` rows (a window, or a whole image)."""
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.heads, -1).permute(1, 0, 2, 3).unbind(0)  # each (N, H, D)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))  # (1, H, N, D)
        outs = [F.scaled_dot_product_attention(qs, ks, vs)
                for qs, ks, vs in zip(*(t.split(lengths, dim=2) for t in (q, k, v)))]
        out = torch.cat(outs, dim=2)[0].transpose(0, 1).reshape(n, -1)  # (N, C)
        return self.proj(out)


class Block(nn.Module):
    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden_size)
        self.norm2 = RMSNorm(cfg.hidden_size)
        self.attn = Attention(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, lengths: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), lengths, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each merge x merge block of patches (consecutive rows) -> one token of the text model's width."""

    def __init__(self, cfg: QwenVisionConfig) -> None:
        super().__init__()
        self.width = cfg.hidden_size * cfg.spatial_merge_size**2
        self.ln_q = RMSNorm(cfg.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(),
                                 nn.Linear(self.width, cfg.out_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class QwenVisionTower(nn.Module):
    """pixel_values (patches, C * T * P * P) + image_grid_thw (images, 3) -> (tokens, out_hidden_size): every
    image's merged tokens in order, one row per `<|image_pad|>`. The decoder rotates the prompt by M-RoPE's 3-D
    positions (`rope_index`)."""

    bidirectional = False  # the image tokens attend causally, as the text does
    prefixes = PREFIXES

    def __init__(self, cfg: QwenVisionConfig, image_token_id: int = -1) -> None:
        super().__init__()
        self.config = cfg
        self.image_token_id = image_token_id
        c = cfg
        self.patch_embed = nn.Conv3d(c.in_channels, c.hidden_size, bias=False,
                                     kernel_size=(c.temporal_patch_size, c.patch_size, c.patch_size),
                                     stride=(c.temporal_patch_size, c.patch_size, c.patch_size))
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.depth))
        self.merger = PatchMerger(c)
        spatial = c.head_dim // 2  # rows and columns each rotate half of the head's angle pairs
        self.inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))

    @classmethod
    def from_checkpoint(cls, raw: dict[str, Any], tensors: dict[str, torch.Tensor]) -> "QwenVisionTower":
        """The tower of a Qwen2_5_VLForConditionalGeneration checkpoint: config.json (its vision_config and
        image_token_id) and the checkpoint's `visual.*` (or `model.visual.*`) tensors, in float32."""
        vision, image_token = raw.get("vision_config"), raw.get("image_token_id")
        if not isinstance(vision, dict) or image_token is None:
            raise ModelLoadError("a Qwen2_5_VLForConditionalGeneration config.json needs vision_config and "
                                 "image_token_id")
        tower = cls(QwenVisionConfig.from_dict(vision), int(image_token))
        return assign(tower, tower_state(tensors), "Qwen2.5-VL vision tower")

    @classmethod
    def from_tensors(cls, raw_vision: dict[str, Any], tensors: dict[str, torch.Tensor]) -> "QwenVisionTower":
        """The tower from config.json's vision_config alone (no placeholder id): features only."""
        return cls.from_checkpoint({"vision_config": raw_vision, "image_token_id": -1}, tensors)

    def encode(self, prepared: Any, image_grid_thw: Any = None) -> torch.Tensor:
        """A Prepared (images/prepared.py; or its pixel_values and image_grid_thw arrays) -> (tokens,
        out_hidden_size) float32 features, image after image."""
        if image_grid_thw is None:
            prepared, image_grid_thw = prepared.pixel_values, prepared.extra["image_grid_thw"]
        device = self.patch_embed.weight.device
        return self(torch.as_tensor(prepared, device=device), torch.as_tensor(image_grid_thw))

    def rope_index(self, ids: list[int], images: Any) -> tuple[torch.Tensor, int]:
        """A prompt's M-RoPE positions (3, T) and the offset later tokens add (rope.mrope_index), its images (each
        with prepared.extra["image_grid_thw"]) in prompt order."""
        grids = [tuple(int(v) for v in g) for im in images for g in im.prepared.extra["image_grid_thw"]]
        return mrope_index(ids, self.image_token_id, grids, self.config.spatial_merge_size)

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        c = self.config
        grids = [tuple(int(v) for v in g) for g in grid_thw.tolist()]
        x = pixel_values.to(self.patch_embed.weight.dtype)
        x = x.view(-1, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size)
        x = self.patch_embed(x).view(-1, c.hidden_size)  # (N, C)
        order, window_lengths = window_index(grids, c)
        unit = c.spatial_merge_size**2
        order = order.to(x.device)
        x = x.view(-1, unit, c.hidden_size)[order].reshape(-1, c.hidden_size)  # windows' blocks consecutive
        angles = rotary_angles(grids, c.spatial_merge_size, self.inv_freq)  # (N, D/2) in image order
        angles = angles.view(-1, unit, angles.shape[-1])[order.cpu()].reshape(-1, angles.shape[-1])
        emb = torch.cat((angles, angles), dim=-1).to(x.device)
        cos, sin = emb.cos(), emb.sin()
        image_lengths = [h * w for t, h, w in grids for _ in range(t)]
        for i, block in enumerate(self.blocks):
            x = block(x, image_lengths if i in c.fullatt_block_indexes else window_lengths, cos, sin)
        return self.merger(x)[torch.argsort(order)]


def window_index(grids: list[tuple[int, int, int]], cfg: QwenVisionConfig) -> tuple[torch.Tensor, list[int]]:
    """The merge blocks' order with each window's blocks consecutive (window after window, row-major, image after
    image), and each window's length in patches (empty windows dropped): transformers' get_vision_window_index."""
    m = cfg.spatial_merge_size
    side = cfg.window_size // m // cfg.patch_size  # a window's side in merge blocks
    order, lengths, offset = [], [], 0
    for t, h, w in grids:
        gh, gw = h // m, w // m
        index = torch.arange(t * gh * gw).reshape(t, gh, gw)
        pad_h, pad_w = side - gh % side, side - gw % side
        nh, nw = (gh + pad_h) // side, (gw + pad_w) // side
        padded = F.pad(index, (0, pad_w, 0, pad_h), "constant", -100)
        padded = padded.reshape(t, nh, side, nw, side).permute(0, 1, 3, 2, 4).reshape(t, nh * nw, side, side)
        counts = (padded != -100).sum([2, 3]).reshape(-1)
        flat = padded.reshape(-1)
        order.append(flat[flat != -100] + offset)
        lengths += [int(n) * m * m for n in counts if n > 0]
        offset += t * gh * gw
    return torch.cat(order), lengths


def rotary_angles(grids: list[tuple[int, int, int]], merge: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """(N, head_dim / 2) rotary angles: each patch's row position times the frequencies, then its column's, in
    the merge-block order of the patches (transformers' get_vision_position_ids)."""
    rows = []
    for t, h, w in grids:
        hpos, wpos = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        block = (h // merge, merge, w // merge, merge)
        hpos, wpos = hpos.reshape(block).transpose(1, 2).flatten(), wpos.reshape(block).transpose(1, 2).flatten()
        rows.append(torch.stack([hpos, wpos], dim=-1).repeat(t, 1))
    freqs = torch.cat(rows)[..., None].float() * inv_freq  # (N, 2, D/4)
    return torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
