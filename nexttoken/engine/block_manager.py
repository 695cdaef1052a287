"""The block manager: which blocks of the paged KV pool (model/cache.py's PagedKVCache) each sequence holds, and
the prefix cache on those same blocks (as nano-vllm's block_manager.py and vLLM v1's block_pool.py).

A sequence's block table lists its blocks in column order (column s in block table[s // block_size]). Blocks are
reference counted: a full block of prompt tokens, computed by a whole prefill chunk, is hashed by its tokens and
every token before it, and a later sequence whose prompt starts with the same tokens takes a reference to it
instead of computing it again (no copy: both tables name the block). A block no sequence holds any more keeps its
contents and its hash; it is handed out again, least recently used first, only when no never-hashed block is free.

Reuse is chunk-aligned, so a request that hits the cache runs exactly the forward passes (same shapes, same
numbers) it would have run alone: only blocks of whole chunks are hashed (a chunk's numbers depend on its length),
and a hit is cut to a whole number of chunks. Prefix caching therefore never changes a greedy or seeded result.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Callable, Hashable

import torch

from ..errors import GenerationConfigError
from ..model import PagedKVCache
from ..model.memory import available_memory
from .sequence import Sequence

DEFAULT_MEMORY_FRACTION = 0.25  # of the memory available at start-up, for the pool when no size is given
NULL_BLOCK = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, chunk_size: int, prefix_caching: bool = True) -> None:
        assert chunk_size % block_size == 0, "a prefill chunk covers whole blocks"
        self.num_blocks, self.block_size, self.chunk_size = num_blocks, block_size, chunk_size
        self.prefix_caching = prefix_caching
        self._free: deque[int] = deque(range(1, num_blocks))  # never hashed (or hash dropped); block 0 is null
        self._refs = [0] * num_blocks
        self._key_of: dict[int, Hashable] = {}  # block -> key of the prefix block it holds
        self._cached: dict[Hashable, int] = {}  # key -> block holding it (held or not)
        self._evictable: OrderedDict[int, None] = OrderedDict()  # hashed blocks nobody holds, least recent first
        self.queried_tokens = 0  # prompt tokens looked up
        # Called with the free blocks written since the last call when the pool holds nothing (the KV pool's
        # `release`: their pages go back to the system, so resident memory follows the tokens held).
        self.release: Callable[[list[int]], None] | None = None
        self._written: set[int] = set()  # blocks handed out since the last release
        self.hit_tokens = 0  # of them, found
        # A hybrid model's recurrent-state checkpoints (state_checkpoints.StateCheckpoints): a hit must end where
        # one is kept, since the K/V blocks alone do not give the state after the prefix. None: attention only.
        self.checkpoints = None

    # ---- sizes -----------------------------------------------------------------------------------------------
    @property
    def capacity_tokens(self) -> int:
        """Tokens one sequence could hold with every block of the pool."""
        return (self.num_blocks - 1) * self.block_size

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (free, or cached and held by nobody)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - 1 - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks holding a hashed prefix block (held or not)."""
        return len(self._cached)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- allocation ------------------------------------------------------------------------------------------
    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Extend seq's table to cover num_tokens columns: True, or False (nothing taken) when the pool lacks it."""
        need = self.blocks_for(num_tokens) - len(seq.block_table)
        if need <= 0:
            return True
        if need > self.num_free:
            return False
        for _ in range(need):
            seq.block_table.append(self._take())
        return True

    def grow_up_to(self, seq: Sequence, num_tokens: int) -> int:
        """Extend seq's table towards num_tokens columns with what is free; the columns it covers after."""
        while len(seq.block_table) * self.block_size < num_tokens and self.num_free:
            seq.block_table.append(self._take())
        return len(seq.block_table) * self.block_size

    def free(self, seq: Sequence) -> None:
        """Drop seq's references, last block first (so a shared prefix's tail is evicted before its head)."""
        for block in reversed(seq.block_table):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._key_of:
                    self._evictable[block] = None
                else:
                    self._free.append(block)
        seq.block_table = []
        if self.release is not None and self.num_used == 0 and self._written:
            self.release(sorted(self._written.difference(self._key_of)))  # prefix-cached blocks stay: they may hit
            self._written.clear()

    def _take(self) -> int:
        if self._free:
            block = self._free.pop()  # the most recently freed: its pages are already resident
        else:
            block, _ = self._evictable.popitem(last=False)  # the least recently used cached block
            del self._cached[self._key_of.pop(block)]
        self._refs[block] = 1
        self._written.add(block)
        return block

    # ---- the prefix cache ------------------------------------------------------------------------------------
    def keys(self, token_ids: list[int], n: int, salt: str | None = None, images: tuple = ()) -> list[Hashable]:
        """Keys of the first n blocks; each names the block's tokens and (by hash) every token before it, and the
        `salt` the K/V were computed under (a LoRA adapter and which load of it: its blocks are never another's).
        `images` (a sequence's PromptImages): a block holding an image's placeholders names that image's content
        hash too, so two prompts with the same tokens but other pictures share no block."""
        keys: list[Hashable] = []
        parent: Hashable = 0 if salt is None else ("salt", salt)
        bs = self.block_size
        for b in range(n):
            key: tuple = (parent, tuple(token_ids[b * bs : (b + 1) * bs]))
            seen = tuple(im.hash for im in images if im.start < (b + 1) * bs and im.end > b * bs)
            key = key + (seen,) if seen else key
            keys.append(key)
            parent = hash(key)
        return keys

    def match(self, seq: Sequence) -> int:
        """Give a sequence with an empty table the cached blocks of its prompt's longest cached prefix (whole chunks,
        at least one prompt token left to compute); returns the tokens found. It holds a reference to each."""
        assert not seq.block_table
        seq.restore_key = None
        if not self.prefix_caching or seq.params.wants_prompt_logprobs:  # those need every prompt position's logits
            return 0
        prompt = seq.prompt_ids
        per_chunk = self.chunk_size // self.block_size
        blocks: list[int] = []
        for key in self.keys(prompt, (len(prompt) - 1) // self.block_size, seq.lora_key, seq.images):
            block = self._cached.get(key)
            if block is None:
                break
            blocks.append(block)
        blocks = blocks[: len(blocks) // per_chunk * per_chunk]
        if self.checkpoints is not None:  # the longest whole-chunk prefix whose state was kept
            keys = self.keys(prompt, len(blocks), seq.lora_key)
            while blocks and not self.checkpoints.has(keys[len(blocks) - 1]):
                blocks = blocks[: len(blocks) - per_chunk]
            seq.restore_key = keys[len(blocks) - 1] if blocks else None
        for block in blocks:
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1
        seq.block_table = blocks
        return len(blocks) * self.block_size

    def record_lookup(self, prompt_tokens: int, hit_tokens: int) -> None:
        """Count an admitted sequence's lookup (the hit rate's numbers)."""
        if self.prefix_caching:
            self.queried_tokens += prompt_tokens
            self.hit_tokens += hit_tokens

    def cache_chunk(self, seq: Sequence, start: int, end: int) -> Hashable | None:
        """After a whole prefill chunk [start, end) of prompt tokens was computed into seq's blocks: hash them, so
        later prompts find them. A key already held by another block (two requests computed the same chunk at
        once) keeps its first block. Returns the key of the chunk's last block (where a hybrid model's state is
        checkpointed), None when the chunk is not cacheable."""
        if not self.prefix_caching or end - start != self.chunk_size or end > len(seq.prompt_ids):
            return None
        if start % self.chunk_size:  # a chunk moved off the grid by an image (scheduler.unsplit): not a whole chunk
            return None
        first, last = start // self.block_size, end // self.block_size
        keys = self.keys(seq.prompt_ids, last, seq.lora_key, seq.images)
        for b, key in enumerate(keys[first:], start=first):
            block = seq.block_table[b]
            if key not in self._cached and block not in self._key_of:
                self._cached[key] = block
                self._key_of[block] = key
        return keys[-1]

    def pending_key(self, seq: Sequence) -> Hashable | None:
        """The key of the last block of seq's next whole prompt chunk (None when that chunk is partial or the
        prefix cache is off): a sequence computing it makes it cacheable for others."""
        end = seq.num_cached + self.chunk_size
        if not self.prefix_caching or end >= len(seq.prompt_ids) or seq.num_cached % self.chunk_size:
            return None
        return self.keys(seq.prompt_ids, end // self.block_size, seq.lora_key, seq.images)[-1]


def pool_blocks(model, max_num_seqs: int, max_model_len: int, block_size: int,  # noqa: ANN001
                kv_cache_memory: int | None, num_kv_blocks: int | None, dtype: torch.dtype, reserved: int = 0) -> int:
    """Blocks of the KV pool (the null block included): `num_kv_blocks`, or `kv_cache_memory` bytes' worth, or by
    default what `max_num_seqs` sequences of `max_model_len` tokens need, capped at DEFAULT_MEMORY_FRACTION of the
    memory available now. Raises GenerationConfigError, naming the bytes and the flags that lower them, when the
    pool cannot be had (checked before anything is allocated). `reserved`: bytes already promised (the recurrent
    layers' state slots), not available to the pool; only the layers that keep K/V count in a block's bytes (the
    others' rows of the pool are never written, so never committed)."""
    mc = model.config
    layers, heads, dim = mc.kv_layout  # the layers with slots of their own, at their widest (Gemma 4)
    # recurrent layers (issue 41) write no K/V: their slots' pages are never touched, so never committed
    kv_layers = layers - sum(not mc.layer(i).keeps_kv for i in range(mc.num_hidden_layers))
    per_block = PagedKVCache.bytes_per_block(max(kv_layers, 1), heads, block_size, dim, dtype)
    available = max(0, available_memory(model.device) - reserved)
    if num_kv_blocks is not None:
        blocks = num_kv_blocks + 1
    elif kv_cache_memory is not None:
        blocks = kv_cache_memory // per_block + 1
    else:
        wanted = max_num_seqs * -(-max_model_len // block_size) + 1
        blocks = min(wanted, int(available * DEFAULT_MEMORY_FRACTION) // per_block + 1)
    if blocks < 2:
        raise GenerationConfigError(
            f"the KV pool must hold at least one block of {block_size} tokens ({per_block} bytes): raise "
            f"--kv-cache-memory (kv_cache_memory) or --num-kv-blocks (num_kv_blocks)")
    need = blocks * per_block
    if need > available:
        raise GenerationConfigError(
            f"the KV pool needs {need} bytes ({need / 2**30:.2f} GiB: {blocks - 1} blocks of {block_size} tokens, "
            f"{per_block} bytes each) but only {available} bytes ({available / 2**30:.2f} GiB) are available: lower "
            f"--kv-cache-memory or --num-kv-blocks, or use --kv-cache-dtype int8 / bf16 (smaller blocks)")
    return blocks
