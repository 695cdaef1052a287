"""The KV caches: a slot cache allocated once for a whole generation (generate()), and the engine's paged pool; both
written in place."""

from __future__ import annotations

import torch

from .batch import ForwardBatch
from .memory import discard_pages, lazy_zeros


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
        # the recurrent layers' state, one slot per row (model/recurrent/slots.py's StateSlots); None: none
        self.states = None

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

    def slots(self, layer: int, batch: ForwardBatch) -> list[torch.Tensor]:
        """A recurrent layer's state of every row, (B, *shape) each (state.py)."""
        return self.states.read(layer, slice(None))

    def keep(self, layer: int, batch: ForwardBatch, state: list[torch.Tensor]) -> None:
        self.states.write(layer, slice(None), state)

    def reorder(self, rows: torch.Tensor, start: int, end: int) -> None:
        """Row b of columns [start, end) takes the K/V of row rows[b], in place (beam search, contrastive search).

        Only that span is copied: beams of one prompt share their prompt columns, so a beam step copies the
        generated columns, never the whole (L, B, Hkv, S, D) buffer.
        """
        if self.states is not None:  # a recurrent state is the whole past: each beam takes its parent's
            self.states.reorder(rows)
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
        bigger.states = self.states
        return bigger


class PagedKVCache:
    """The engine's KV pool: keys and values of every layer in fixed-size blocks, (L, N, Hkv, bs, D) each.

    A sequence's columns live in the blocks its block table names (column s in block table[s // bs], offset
    s % bs), so memory goes to the tokens that exist, not to a slot as long as the longest request. Block 0 is the
    null block: never handed out, all zeros, where the unused entries of a padded block table point (attention
    masks those columns, and a zero is finite, so masking them leaves the sums exactly as they are).

    The element type is the model's, bfloat16 (half of float32's memory) or int8 (a quarter): int8 keys and values
    carry one float32 scale per token and head (`k_scale`, `v_scale` (L, N, Hkv, bs): absmax / 127 over the head's
    D values), so a token's error never depends on other tokens. Reads give back the values as stored (`stored`),
    and every reader sees those, the new token's own column included.

    The pool is one anonymous mapping (model/memory.py's `lazy_zeros`): its pages are committed as blocks are first
    written, so a large pool costs the memory of the tokens actually held.
    """

    def __init__(self, n_layers: int, n_blocks: int, n_kv_heads: int, block_size: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (n_layers, n_blocks, n_kv_heads, block_size, head_dim)  # (L, N, Hkv, bs, D)
        self.k = lazy_zeros(shape, dtype, device)
        self.v = lazy_zeros(shape, dtype, device)
        self.k_scale = self.v_scale = None
        if dtype == torch.int8:
            self.k_scale = lazy_zeros(shape[:-1], torch.float32, device)  # (L, N, Hkv, bs)
            self.v_scale = lazy_zeros(shape[:-1], torch.float32, device)

    @property
    def block_size(self) -> int:
        return self.k.shape[3]

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        scales = 0 if self.k_scale is None else self.k_scale.nbytes + self.v_scale.nbytes
        return self.k.nbytes + self.v.nbytes + scales

    def release(self, blocks: list[int]) -> None:
        """Give back the memory of `blocks` (free, holding nothing anyone reads: they read as zeros after), so
        resident memory follows the tokens held. Runs of neighbouring blocks are released together, per layer; a
        block smaller than a page releases only the pages its run covers whole."""
        runs: list[list[int]] = []
        for b in sorted(blocks):
            if runs and runs[-1][1] == b:
                runs[-1][1] = b + 1
            else:
                runs.append([b, b + 1])
        for t in (self.k, self.v, self.k_scale, self.v_scale):
            if t is None or t.device.type != "cpu":
                continue
            n_blocks, per_block = t.shape[1], t[0, 0].nbytes  # (L, N, ...): a layer's blocks are contiguous
            for layer in range(t.shape[0]):
                for lo, hi in runs:
                    discard_pages(t, (layer * n_blocks + lo) * per_block, (layer * n_blocks + hi) * per_block)

    @staticmethod
    def bytes_per_block(n_layers: int, n_kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype) -> int:
        """Memory of one block's keys and values (and int8 scales) across all layers."""
        per_value = head_dim * dtype.itemsize + (4 if dtype == torch.int8 else 0)
        return 2 * n_layers * n_kv_heads * block_size * per_value

    def stored(self, x: torch.Tensor) -> torch.Tensor:
        """What storing x (..., D) and reading it back gives, in x's dtype."""
        if self.k.dtype == x.dtype:
            return x
        if self.k_scale is None:
            return x.to(self.k.dtype).to(x.dtype)
        q, scale = _quantize(x)
        return (q.float() * scale[..., None]).to(x.dtype)

    def write(self, layer: int, cols: torch.Tensor, table: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store one sequence's k, v (Hkv, T, D) at its columns cols (T,), through its block table (>= blocks,)."""
        bs = self.block_size
        blocks, offsets = table[cols // bs], cols % bs  # (T,) each
        self.put(layer, blocks, offsets, k.transpose(0, 1), v.transpose(0, 1))

    def put(self, layer: int, blocks: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v (T, Hkv, D) at (blocks[t], offsets[t]) of this layer."""
        for store, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            if scales is None:
                store[layer][blocks, :, offsets] = x.to(store.dtype)  # indexed view is (T, Hkv, D)
            else:
                q, scale = _quantize(x)
                store[layer][blocks, :, offsets] = q
                scales[layer][blocks, :, offsets] = scale

    def gather(self, layer: int, tables: torch.Tensor, span: int,
               dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `span` columns of each row's blocks, tables (B, >= span / bs) -> k, v (B, Hkv, span, D) copies
        in `dtype` (default: the pool's)."""
        n = -(-span // self.block_size)
        out = []
        for store, scales in ((self.k[layer], self.k_scale), (self.v[layer], self.v_scale)):
            rows = store[tables[:, :n]]  # (B, n, Hkv, bs, D)
            if scales is not None:
                rows = rows.float() * scales[layer][tables[:, :n]][..., None]
            if dtype is not None:
                rows = rows.to(dtype)
            B, _, H, bs, D = rows.shape
            out.append(rows.transpose(1, 2).reshape(B, H, n * bs, D)[:, :, :span])
        return out[0], out[1]


def _quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) -> int8 values (..., D) and float32 scales (...,): symmetric, absmax / 127 per vector."""
    x = x.float()
    scale = x.abs().amax(-1) / 127.0
    q = torch.round(x / torch.where(scale > 0, scale, 1.0)[..., None]).clamp_(-127, 127).to(torch.int8)
    return q, scale
