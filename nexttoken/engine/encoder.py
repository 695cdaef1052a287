"""The encoder cache (issue 43): each image's features, keyed by its content hash, so a second request with the same
picture (or a preempted request prefilled again) does not run the vision tower again, as vLLM's encoder cache.

Each image is encoded alone (images/prepared.py's PromptImage holds it prepared alone): its features then never
depend on the other images of its request, and a cached entry is the same bits a fresh encoding gives. The cache
is bounded in bytes (least recently used entries go first); the engine reserves those bytes out of the KV pool's
memory, so the encoder's memory is counted in the budget."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

DEFAULT_ENCODER_CACHE_BYTES = 64 * 2**20


class EncoderCache:
    def __init__(self, tower: Any, max_bytes: int = DEFAULT_ENCODER_CACHE_BYTES) -> None:
        self.tower, self.max_bytes = tower, max_bytes
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()  # hash -> (tokens, text hidden) features
        self.bytes = 0
        self.encoded = 0  # images run through the tower (a hit adds nothing)
        self.hits = 0

    def features(self, image: Any) -> torch.Tensor:
        """(image.tokens, C) float32 rows of one PromptImage, from the cache or encoded now."""
        rows = self._entries.get(image.hash)
        if rows is not None:
            self._entries.move_to_end(image.hash)
            self.hits += 1
            return rows
        rows = self.tower.encode(image.prepared)
        self.encoded += 1
        if rows.shape[0] != image.tokens:
            raise ValueError(f"the vision tower gave {rows.shape[0]} rows for an image of {image.tokens} tokens")
        size = rows.numel() * rows.element_size()
        if size <= self.max_bytes:
            while self.bytes + size > self.max_bytes:
                _, old = self._entries.popitem(last=False)
                self.bytes -= old.numel() * old.element_size()
            self._entries[image.hash] = rows
            self.bytes += size
        return rows

    def __len__(self) -> int:
        return len(self._entries)
