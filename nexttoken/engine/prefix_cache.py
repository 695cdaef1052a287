"""Prefix caching: K/V of prompt blocks, keyed by their token ids and everything before them, reused by new
requests that start with the same tokens.

A block is one prefill chunk (`block_size` tokens starting at a multiple of it). Reuse is therefore always
chunk-aligned, so a request that hits the cache runs exactly the forward passes (same shapes, same numbers)
it would have run alone: prefix caching never changes a greedy result. The store is a preallocated pool of
`n_blocks` blocks with least-recently-used eviction, so its memory is bounded like the slots'.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable

import torch


class PrefixCache:
    def __init__(
        self,
        n_blocks: int,
        block_size: int,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.n_blocks, self.block_size = n_blocks, block_size
        shape = (n_layers, n_blocks, n_kv_heads, block_size, head_dim)  # (L, N, Hkv, C, D)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self._index: OrderedDict[Hashable, int] = OrderedDict()  # key -> pool block, oldest use first
        self._free = list(range(n_blocks))
        self.queried_tokens = 0  # prompt tokens looked up
        self.hit_tokens = 0  # of them, found

    @property
    def enabled(self) -> bool:
        return self.n_blocks > 0

    def keys(self, token_ids: list[int], n: int, salt: str | None = None) -> list[Hashable]:
        """Keys of the first n blocks; each names the block's tokens and (by hash) every token before it, and the
        `salt` the K/V were computed under (a LoRA adapter: its blocks are never another adapter's)."""
        keys: list[Hashable] = []
        parent: Hashable = 0 if salt is None else ("salt", salt)
        for b in range(n):
            key = (parent, tuple(token_ids[b * self.block_size : (b + 1) * self.block_size]))
            keys.append(key)
            parent = hash(key)
        return keys

    def match(self, token_ids: list[int], salt: str | None = None) -> list[int]:
        """Pool blocks holding the longest cached prefix, leaving at least one token to compute (for logits)."""
        if not self.enabled:
            return []
        self.queried_tokens += len(token_ids)
        blocks: list[int] = []
        for key in self.keys(token_ids, (len(token_ids) - 1) // self.block_size, salt):
            block = self._index.get(key)
            if block is None:
                break
            self._index.move_to_end(key)
            blocks.append(block)
        self.hit_tokens += len(blocks) * self.block_size
        return blocks

    def reserve(self, token_ids: list[int], block_number: int, salt: str | None = None) -> int | None:
        """A pool block to store block `block_number` of these tokens in, or None when it is already stored."""
        if not self.enabled:
            return None
        key = self.keys(token_ids, block_number + 1, salt)[-1]
        if key in self._index:
            self._index.move_to_end(key)
            return None
        if self._free:
            block = self._free.pop()
        else:
            _, block = self._index.popitem(last=False)  # evict the least recently used
        self._index[key] = block
        return block
