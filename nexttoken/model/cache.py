"""The KV cache: allocated once for the whole generation and written in place."""

from __future__ import annotations

import torch

from .batch import ForwardBatch


class KVCache:
    """Keys and values of every layer, (layers, B, kv_heads, max_len, head_dim) each."""

    def __init__(
        self,
        n_layers: int,
        batch_size: int,
        n_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (n_layers, batch_size, n_kv_heads, max_len, head_dim)  # (L, B, Hkv, S, D)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self._rows = torch.arange(batch_size, device=device)[:, None]  # (B, 1) for per-row writes

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    def update(
        self, layer: int, batch: ForwardBatch, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, Hkv, T, D) at the batch's cache columns; return the readable span (B, Hkv, S, D)."""
        k_layer, v_layer = self.k[layer], self.v[layer]
        if batch.write_start is not None:  # every row writes the same columns: a plain slice, no scatter
            end = batch.write_start + k.shape[2]
            k_layer[:, :, batch.write_start : end] = k
            v_layer[:, :, batch.write_start : end] = v
        else:
            k_layer[self._rows, :, batch.write_index] = k.transpose(1, 2)  # indexed view is (B, T, Hkv, D)
            v_layer[self._rows, :, batch.write_index] = v.transpose(1, 2)
        return k_layer[:, :, : batch.kv_len], v_layer[:, :, : batch.kv_len]

    def reorder(self, rows: torch.Tensor, start: int, end: int) -> None:
        """Row b of columns [start, end) takes the K/V of row rows[b], in place (beam search, contrastive search).

        Only that span is copied: beams of one prompt share their prompt columns, so a beam step copies the
        generated columns, never the whole (L, B, Hkv, S, D) buffer.
        """
        if end <= start:
            return
        self.k[:, :, :, start:end] = self.k[:, rows, :, start:end]  # (L, B, Hkv, end-start, D)
        self.v[:, :, :, start:end] = self.v[:, rows, :, start:end]

    def extended(self, max_len: int) -> "KVCache":
        """A cache with room for max_len columns holding this one's content (one copy, to continue a generation)."""
        if max_len <= self.max_len:
            return self
        L, B, H, S, D = self.k.shape
        bigger = KVCache(L, B, H, max_len, D, self.k.dtype, self.k.device)
        bigger.k[:, :, :, :S] = self.k
        bigger.v[:, :, :, :S] = self.v
        return bigger
