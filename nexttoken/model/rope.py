"""Rotary position embeddings, including Llama 3.1's frequency scaling.

Frequencies are computed in float32 and cos/sin are cast to the activation dtype last, as transformers does:
changing that order changes bf16 results in the last bit and breaks token parity.
"""

from __future__ import annotations

import math

import torch

from ..config import RopeConfig
from ..errors import ImageError


def inverse_frequencies(rope: RopeConfig, head_dim: int, long: bool = False) -> torch.Tensor:
    """(head_dim/2,) float32 inverse frequencies for this RoPE variant (longrope: the short set, or with `long` the
    set for sequences beyond the original context)."""
    # Explicit CPU so that building a model under `torch.device("meta")` still gets real frequencies.
    if rope.type == "proportional":  # Gemma 4: the first share over the whole head_dim, the rest zero (no rotation)
        angles = int(rope.partial_rotary_factor * head_dim // 2)
        rotated = 1.0 / rope.theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64, device="cpu").float() / head_dim)
        return torch.cat([rotated, torch.zeros(head_dim // 2 - angles, device="cpu")]) / rope.factor
    head_dim = int(head_dim * rope.partial_rotary_factor)  # partial RoPE (GLM-4 MoE): only these dims rotate
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    if rope.type == "longrope":  # transformers' order: 1 / (factors * base ** exponent)
        factors = torch.tensor(rope.long_factor if long else rope.short_factor, dtype=torch.float32, device="cpu")
        return 1.0 / (factors * rope.theta**exponent)
    inv_freq = 1.0 / (rope.theta**exponent)
    if rope.type == "linear":
        return inv_freq / rope.factor
    if rope.type == "llama3":
        return _llama3_scaling(inv_freq, rope)
    if rope.type == "yarn":
        return _yarn(rope, head_dim)
    return inv_freq


def _yarn(rope: RopeConfig, dim: int) -> torch.Tensor:
    """YaRN's frequencies (gpt-oss), transformers' `_compute_yarn_parameters` step by step: extrapolated (the
    base's) above beta_fast rotations over the original context, interpolated (divided by factor) below beta_slow,
    blended by a linear ramp between. (The cos/sin scale is rope.attention_factor, applied by rope_cos_sin.)"""

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, device="cpu").to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (rope.factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    keep = 1 - ramp  # the share of the extrapolated (unscaled) frequency
    return interpolation * (1 - keep) + extrapolation * keep


def _llama3_scaling(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, and the band between is interpolated.
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def longrope_inv_freq(rope: RopeConfig, short: torch.Tensor, long: torch.Tensor | None,
                      positions: torch.Tensor) -> torch.Tensor:
    """The frequencies one forward rotates with. LongRoPE as transformers (and vLLM) decide it: the long set once
    the furthest position in the forward passes the original context, for every row of that forward."""
    if long is None or int(positions.max()) + 1 <= rope.original_max_position_embeddings:
        return short
    return long


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype, scaling: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin, each (B, 1, T, head_dim), for integer positions (B, T).

    The sin table's first half is negated: apply_rope then rotates with one roll instead of transformers'
    rotate_half (two slices, a negation and a cat per layer); -a * b == a * -b exactly, so results are identical.
    """
    return _tables(positions.float()[..., None] * inv_freq, dtype, scaling)  # angles (B, T, D/2)


def mrope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype, section: tuple[int, ...],
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """M-RoPE's tables (Qwen2-VL, Qwen2.5-VL) for positions (3, B, T): temporal, height, width. The angle pairs
    split into `section`'s runs, run i rotating by position row i % 3 (transformers' recomposition_frequencies);
    `interleaved` (Qwen3-VL): pair j rotates by the height row where j % 3 == 1 and j < 3 * section[1], by the width
    row where j % 3 == 2 and j < 3 * section[2], else by the temporal row. Rows all equal: the plain RoPE."""
    freqs = positions.float()[..., None] * inv_freq  # (3, B, T, D/2)
    if interleaved:
        mixed = freqs[0].clone()
        for row in (1, 2):
            picked = slice(row, section[row] * 3, 3)
            mixed[..., picked] = freqs[row][..., picked]
    else:
        mixed = torch.cat([run[i % 3] for i, run in enumerate(freqs.split(list(section), dim=-1))], dim=-1)
    return _tables(mixed, dtype, 1.0)


def _tables(freqs: torch.Tensor, dtype: torch.dtype, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Angles (B, T, D/2) -> cos and signed sin, each (B, 1, T, D)."""
    emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, D): halves layout, as in transformers' rotate_half
    cos, sin = emb.cos(), emb.sin()
    if scaling != 1.0:  # LongRoPE's attention factor, in float32 before the cast as transformers does
        cos, sin = cos * scaling, sin * scaling
    sin = sin.to(dtype)
    sin[..., : freqs.shape[-1]].neg_()
    return cos.to(dtype)[:, None], sin[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, H, T, D) by the position angles (tables from rope_cos_sin). Tables narrower than D (partial
    RoPE: R < D dims) rotate the first R dims and pass the rest, as transformers' GLM-4 does."""
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:
        x, rest = x[..., :rotary], x[..., rotary:]
        return torch.cat([x * cos + x.roll(rotary // 2, dims=-1) * signed_sin, rest], dim=-1)
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin  # roll * signed sin == rotate_half(x) * sin


def mrope_index(
    ids: list[int], image_token_id: int, grids: list[tuple[int, int, int]], merge: int
) -> tuple[torch.Tensor, int]:
    """Qwen2.5-VL's 3-D positions of one prompt (transformers' get_rope_index): (3, T) int64 and the offset
    (max position + 1 - T) that later tokens add to their index. Text counts up on all three rows; image i's
    grid_t x (grid_h / merge) x (grid_w / merge) tokens take the current position plus their (t, h, w) in the
    grid, and the text after it continues from the current position + max(grid_h, grid_w) / merge."""
    rows, pos, i, n, images = [], 0, 0, len(ids), iter(grids)
    while i < n:
        j = i
        if ids[i] == image_token_id:
            t, h, w = next(images, (0, 0, 0))
            gt, gh, gw = t, h // merge, w // merge
            j = i + gt * gh * gw
            if gt == 0 or j > n or any(x != image_token_id for x in ids[i:j]):
                raise ImageError(f"the prompt's image tokens at {i} do not match the images' grids {grids}")
            tt, hh, ww = torch.meshgrid(torch.arange(gt), torch.arange(gh), torch.arange(gw), indexing="ij")
            rows.append(torch.stack([tt, hh, ww]).reshape(3, -1) + pos)
            pos += max(h, w) // merge
        else:
            while j < n and ids[j] != image_token_id:
                j += 1
            rows.append(torch.arange(pos, pos + j - i).expand(3, -1))
            pos += j - i
        i = j
    if next(images, None) is not None:
        raise ImageError(f"the prompt has fewer image tokens than the images' grids {grids} take")
    positions = torch.cat(rows, dim=1) if rows else torch.zeros(3, 0, dtype=torch.int64)
    return positions, (int(positions.max()) + 1 - n) if n else 0


def pairs_to_halves(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """q / k rows (or biases) of whole heads, each head's dims rotating in adjacent pairs (2i, 2i + 1: ERNIE 4.5)
    -> the same rows in NeoX halves (i, i + head_dim / 2), the order the model rotates: a permutation of each head's
    dims, applied to q and k alike, so every q.k product is unchanged. (llama.cpp's converter applies the inverse to
    Llama's rows; weights/gguf.py's _unpermute is this map.)"""
    half = head_dim // 2
    return rows.reshape(-1, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)  # (H, half, 2) -> (H, 2, half)
