"""Qwen3-VL's vision tower: Qwen2.5-VL's patches and 2-D rotary (qwen_vl.py), plus a learned position table
(bilinearly resampled, corners aligned, to each image's patch grid), LayerNorm blocks with a GELU MLP, attention over
each whole image, and besides the final patch merger the DeepStack mergers: the outputs of blocks
`deepstack_visual_indexes` merged into text-width rows that the decoder adds to the image tokens' hidden states
after its first layers. transformers' modeling_qwen3_vl.py (Qwen3VLVisionModel) and vision_utils.py, in float32.

`encode` returns (tokens, out_hidden * (1 + deepstack)): each row the final merger's, then each DeepStack merger's
(model/batch.py's ForwardBatch.embeds carries them whole; the decoder splits them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import ModelLoadError
from ..rope import mrope_index
from .checkpoint import assign
from .qwen_vl import PREFIXES, Attention, QwenVisionConfig, activation, rotary_angles, tower_state


@dataclass(frozen=True)
class Qwen3VisionConfig(QwenVisionConfig):
    """config.json's `vision_config` (Qwen3VLVisionConfig's fields and defaults)."""

    depth: int = 27
    hidden_size: int = 1152
    intermediate_size: int = 4304
    patch_size: int = 16
    hidden_act: str = "gelu_pytorch_tanh"
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "Qwen3VisionConfig":
        rope = raw.get("rope_parameters") or {}
        known = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw and k != "rope_theta"}
        known["fullatt_block_indexes"] = ()
        known["deepstack_visual_indexes"] = tuple(known.get("deepstack_visual_indexes", cls.deepstack_visual_indexes))
        return cls(**known, rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))))


class MLP(nn.Module):
    def __init__(self, cfg: Qwen3VisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Block(nn.Module):
    def __init__(self, cfg: Qwen3VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = Attention(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, lengths: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), lengths, cos, sin)
        return x + self.mlp(self.norm2(x))


class Merger(nn.Module):
    """merge x merge patches (consecutive rows) -> one text-width row; the DeepStack mergers norm after joining."""

    def __init__(self, cfg: Qwen3VisionConfig, norm_after: bool) -> None:
        super().__init__()
        self.width, self.norm_after = cfg.hidden_size * cfg.spatial_merge_size**2, norm_after
        self.norm = nn.LayerNorm(self.width if norm_after else cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, cfg.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.width)) if self.norm_after else self.norm(x).view(-1, self.width)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3VisionTower(nn.Module):
    """pixel_values (patches, C * T * P * P) + image_grid_thw (images, 3) -> (tokens, out_hidden * (1 + k)):
    the final merger's row, then the k DeepStack mergers' rows, one per `<|image_pad|>`."""

    bidirectional = False
    prefixes = PREFIXES

    def __init__(self, cfg: Qwen3VisionConfig, image_token_id: int = -1) -> None:
        super().__init__()
        self.config, self.image_token_id = cfg, image_token_id
        c = cfg
        kernel = (c.temporal_patch_size, c.patch_size, c.patch_size)
        self.patch_embed = nn.Conv3d(c.in_channels, c.hidden_size, kernel_size=kernel, stride=kernel)
        self.pos_embed = nn.Embedding(c.num_position_embeddings, c.hidden_size)
        self.side = int(c.num_position_embeddings**0.5)  # the learned table is side x side
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.depth))
        self.merger = Merger(c, norm_after=False)
        self.deepstack_merger_list = nn.ModuleList(Merger(c, norm_after=True) for _ in c.deepstack_visual_indexes)
        spatial = c.head_dim // 2
        self.inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))

    @classmethod
    def from_checkpoint(cls, raw: dict[str, Any], tensors: dict[str, torch.Tensor]) -> "Qwen3VisionTower":
        """The tower of a Qwen3VLForConditionalGeneration checkpoint (config.json's vision_config and
        image_token_id; the `model.visual.*` or `visual.*` tensors), in float32."""
        vision, image_token = raw.get("vision_config"), raw.get("image_token_id")
        if not isinstance(vision, dict) or image_token is None:
            raise ModelLoadError("a Qwen3VLForConditionalGeneration config.json needs vision_config and "
                                 "image_token_id")
        tower = cls(Qwen3VisionConfig.from_dict(vision), int(image_token))
        return assign(tower, tower_state(tensors), "Qwen3-VL vision tower")

    def encode(self, prepared: Any) -> torch.Tensor:
        """A Prepared (images/prepared.py) -> (tokens, out_hidden * (1 + k)) float32 rows, image after image."""
        device = self.patch_embed.weight.device
        return self(torch.as_tensor(prepared.pixel_values, device=device),
                    torch.as_tensor(prepared.extra["image_grid_thw"]))

    def rope_index(self, ids: list[int], images: Any) -> tuple[torch.Tensor, int]:
        """The prompt's M-RoPE positions (3, T) and later tokens' offset (rope.mrope_index)."""
        grids = [tuple(int(v) for v in g) for im in images for g in im.prepared.extra["image_grid_thw"]]
        return mrope_index(ids, self.image_token_id, grids, self.config.spatial_merge_size)

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        c = self.config
        grids = [tuple(int(v) for v in g) for g in grid_thw.tolist()]
        x = pixel_values.to(self.patch_embed.weight.dtype)
        x = self.patch_embed(x.view(-1, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size))
        x = x.view(-1, c.hidden_size) + self._positions(grids)
        angles = rotary_angles(grids, c.spatial_merge_size, self.inv_freq)
        emb = torch.cat((angles, angles), dim=-1).to(x.device)
        cos, sin = emb.cos(), emb.sin()
        lengths = [h * w for t, h, w in grids for _ in range(t)]  # each image (frame) attends itself
        deep = []
        for i, block in enumerate(self.blocks):
            x = block(x, lengths, cos, sin)
            if i in c.deepstack_visual_indexes:
                deep.append(self.deepstack_merger_list[c.deepstack_visual_indexes.index(i)](x))
        return torch.cat([self.merger(x), *deep], dim=-1)

    def _positions(self, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """(N, hidden) learned positions: the side x side table resampled bilinearly (align_corners) to each
        image's grid, in the patches' merge-block order (transformers' get_vision_interpolation_indices_and_weights
        with pos_embed, summed over the 4 taps)."""
        m, side, out = self.config.spatial_merge_size, self.side, []
        for t, h, w in grids:
            rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
            block = (h // m, m, w // m, m)
            rows, cols = rows.reshape(block).transpose(1, 2).flatten(), cols.reshape(block).transpose(1, 2).flatten()
            (rt, rw), (ct, cw) = _taps(rows, h, side), _taps(cols, w, side)
            index = (rt[:, :, None] * side + ct[:, None, :]).reshape(-1, 4)
            weight = (rw[:, :, None] * cw[:, None, :]).reshape(-1, 4)
            device = self.pos_embed.weight.device
            out.append((self.pos_embed(index.to(device)) * weight.to(device)[:, :, None]).sum(1).repeat(t, 1))
        return torch.cat(out)


def _taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear taps (floor, floor + 1, clamped) into a `side`-long axis and their weights for positions `index` of
    a `size`-long one, corners aligned."""
    src = index.float() * (side - 1) / max(size - 1, 1)
    floor = torch.floor(src)
    offsets = torch.arange(0, 2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


class Qwen35VisionTower(Qwen3VisionTower):
    """Qwen3.5's tower (transformers' Qwen3_5VisionModel): Qwen3-VL's without DeepStack, one out_hidden row per
    `<|image_pad|>`. Qwen3.5 declares its text family (families/qwen35.py) for Qwen3_5ForCausalLM checkpoints too:
    a config.json without `vision_config` (a text model), or a checkpoint without any tower tensor (a text-only
    export that kept the config), has no tower (None)."""

    @classmethod
    def from_checkpoint(cls, raw: dict[str, Any], tensors: dict[str, torch.Tensor]) -> "Qwen35VisionTower | None":
        if "vision_config" not in raw or not tensors:
            return None
        vision = raw["vision_config"]
        if not isinstance(vision, dict) or raw.get("image_token_id") is None:
            raise ModelLoadError("a Qwen3_5ForConditionalGeneration config.json needs vision_config and "
                                 "image_token_id")
        return super().from_checkpoint({**raw, "vision_config": {**vision, "deepstack_visual_indexes": []}}, tensors)
