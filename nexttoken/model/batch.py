"""Per-forward metadata: where each new token sits in the sequence and in the cache, and what it may see."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    positions: torch.Tensor  # (B, T) rotary position of each new token
    write_index: torch.Tensor  # (B, T) cache column each new token's K/V is written to
    kv_len: int  # cache columns [0, kv_len) are read
    mask: torch.Tensor | None  # (B, 1, T, kv_len) bool: True where a query may attend a cache column (None: all)
    window_mask: torch.Tensor | None = None  # the same, limited to the sliding window (None: no such layers)
    write_start: int | None = None  # set when every row writes columns write_start..+T (a slice is enough)
    last_only: bool = True  # compute logits for the last position only (generation needs no more)
    # Attention one row at a time. CPU SDPA splits a batch across threads and a row's numbers then depend on
    # which thread (so which batch-mates) it got; the engine's decode groups set this so they cannot.
    rowwise: bool = False
    # LoRA (model/lora/): (B,) int64, the adapter slot each row applies (-1: the base model alone); None: no row does
    lora: torch.Tensor | None = None
    # The masks say nothing but the sliding window: one new token per row at the last column, no padding, so every
    # column is visible to the global layers and the last `sliding_window` to the sliding ones (model/fused.py's
    # native step computes that window itself).
    window_only: bool = False
    # (B, T) bool: which new tokens are real (False: left padding, which the recurrent layers zero so it leaves
    # their state as it was); None: all of them.
    token_valid: torch.Tensor | None = None
    # Images (issue 43): ((B, T) bool, the new tokens whose embedding is replaced; (N, C) the rows that replace them,
    # in the mask's row-major order), applied after the embedding and its scale, as transformers'
    # `inputs_embeds.masked_scatter(image_mask, features)`; None: text only.
    embeds: tuple[torch.Tensor, torch.Tensor] | None = None
    # M-RoPE (Qwen2.5-VL): (3, B, T) int64 temporal / height / width positions of the new tokens (rope.mrope_index),
    # given where a row's new tokens hold image tokens; None: every token rotates by `positions` on all three rows
    mrope_positions: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        positions: torch.Tensor,
        write_index: torch.Tensor,
        key_valid: torch.Tensor,
        kv_len: int,
        sliding_window: int | None = None,
        write_start: int | None = None,
        last_only: bool = True,
        padding_free: bool = False,
    ) -> "ForwardBatch":
        """Masks from `key_valid` (B, >= kv_len): which cache columns hold real (non-padding) tokens.
        `padding_free`: the caller knows every column is real (key_valid is then not read)."""
        plain = _sees_everything(write_index, key_valid, kv_len, write_start, padding_free)
        if plain and (sliding_window is None or kv_len <= sliding_window):
            # A plain decode step (one new token per row at the last column, no padding): every column is visible,
            # so no mask is built and attention runs unmasked (adding an all-zero mask changes nothing).
            return cls(positions, write_index, kv_len, None, None, write_start, last_only)
        cols = torch.arange(kv_len, device=write_index.device)  # (S,)
        query_col = write_index[:, :, None]  # (B, T, 1)
        allowed = key_valid[:, None, :kv_len] & (cols <= query_col)  # (B, T, S): causal over real tokens
        # A padding query would otherwise see nothing, and SDPA turns an all-masked row into NaN, which then
        # leaks into the cache. Letting every query see itself keeps those rows finite; no real token reads them.
        itself = cols == query_col
        mask = (allowed | itself)[:, None]
        window_mask = None
        if sliding_window is not None:
            window_mask = ((allowed & (cols > query_col - sliding_window)) | itself)[:, None]
        valid = None  # only several new tokens per row can hold padding (a decode step's token is always real)
        if write_index.shape[1] > 1:
            valid = key_valid[:, :kv_len].gather(1, write_index.clamp(max=kv_len - 1))  # (B, T)
            valid = None if bool(valid.all()) else valid
        return cls(positions, write_index, kv_len, mask, window_mask, write_start, last_only, window_only=plain,
                   token_valid=valid)

    def with_blocks(self, groups: torch.Tensor, sliding_window: int | None = None,
                    full: bool = True) -> "ForwardBatch":
        """The same batch where the new tokens of one block (an image's, Gemma 3's token_type_ids) also attend each
        other forward, as transformers' blockwise overlay: groups (B, T) int64, >= 0 a block's id, -1 causal text.
        The sliding layers' mask keeps its window on top (AND(window, OR(causal, block))); full False: only the
        sliding layers' (Gemma 4's use_bidirectional_attention "vision"), the full layers stay causal."""
        assert self.mask is not None, "blocks only change a mask the prefill built"
        B, T = groups.shape
        same = (groups[:, :, None] == groups[:, None, :]) & (groups[:, :, None] >= 0)  # (B, T, T) query x new key
        extra = torch.zeros(B, T, self.kv_len, dtype=torch.bool, device=groups.device)
        extra.scatter_(2, self.write_index[:, None, :].expand(B, T, T), same)  # new keys sit at their write columns
        mask, window = (self.mask | extra[:, None]) if full else self.mask, self.window_mask
        if window is not None:
            cols = torch.arange(self.kv_len, device=groups.device)
            near = cols > self.write_index[:, :, None] - (sliding_window if sliding_window is not None else self.kv_len)
            window = window | (extra & near)[:, None]
        return dataclasses.replace(self, mask=mask, window_mask=window)


def _sees_everything(
    write_index: torch.Tensor, key_valid: torch.Tensor, kv_len: int, write_start: int | None,
    padding_free: bool = False,
) -> bool:
    """One new token per row at the last column and no padding: every column is real and before the query."""
    # key_valid is only read on CPU, where reading it back costs a few microseconds, not a device sync.
    return (
        write_index.shape[1] == 1
        and write_start == kv_len - 1
        and key_valid.device.type == "cpu"
        and (padding_free or bool(key_valid[:, :kv_len].all()))
    )
