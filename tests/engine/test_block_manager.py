"""The block manager (engine/block_manager.py) on its own: allocation, freeing, reference counts, prefix-cache
hits (whole chunks only), eviction order and running out of blocks, every block id worked out by hand.

Block 0 is the null block; the free list starts as [1, 2, ..., N-1] and hands out its most recently freed block
first (its right end), so a fresh manager's first blocks are N-1, N-2, ...
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nexttoken.engine.block_manager import BlockManager, pool_blocks
from nexttoken.errors import GenerationConfigError
from support.sequences import make_seq

PROMPT = list(range(10, 19))  # 9 tokens: blocks of 2 -> [10 11] [12 13] [14 15] [16 17] [18]


def test_sizes() -> None:
    bm = BlockManager(num_blocks=6, block_size=2, chunk_size=4)
    assert (bm.capacity_tokens, bm.num_free, bm.num_used, bm.num_cached) == (10, 5, 0, 0)
    assert [bm.blocks_for(n) for n in (0, 1, 2, 3, 4, 5)] == [0, 1, 1, 2, 2, 3]


def test_grow_takes_what_is_missing_and_nothing_when_the_pool_lacks_it() -> None:
    bm = BlockManager(num_blocks=6, block_size=2, chunk_size=4)
    a, b, c = make_seq("a", PROMPT), make_seq("b", PROMPT), make_seq("c", PROMPT)
    assert bm.grow(a, 3) and a.block_table == [5, 4] and (bm.num_free, bm.num_used) == (3, 2)
    assert bm.grow(a, 4) and a.block_table == [5, 4]  # covered already
    assert not bm.grow(a, 11) and a.block_table == [5, 4] and bm.num_free == 3  # 4 more needed, 3 free: none taken
    assert bm.grow_up_to(b, 100) == 6 and b.block_table == [3, 2, 1] and bm.num_free == 0
    assert not bm.grow(c, 1) and c.block_table == []
    bm.free(a)
    assert a.block_table == [] and bm.num_free == 2
    assert bm.grow(c, 2) and c.block_table == [5]  # the most recently freed: a's first block, freed last


def test_a_cached_prefix_is_shared_by_reference_in_whole_chunks() -> None:
    bm = BlockManager(num_blocks=10, block_size=2, chunk_size=4)
    a = make_seq("a", PROMPT)
    assert bm.grow(a, 4) and a.block_table == [9, 8]
    bm.cache_chunk(a, 0, 4)  # the first chunk computed: blocks 9 and 8 hashed
    bm.cache_chunk(a, 4, 6)  # not a whole chunk: not hashed
    assert bm.num_cached == 2
    b = make_seq("b", PROMPT[:4] + [50, 51, 52, 53, 54])
    assert bm.match(b) == 4 and b.block_table == [9, 8]
    assert bm.num_free == 7  # shared, not copied
    bm.record_lookup(len(b.prompt_ids), 4)
    assert (bm.queried_tokens, bm.hit_tokens) == (9, 4)
    bm.free(a)
    assert bm.num_free == 7  # b still holds both
    bm.free(b)
    assert (bm.num_free, bm.num_cached) == (9, 2)  # held by nobody: free to take, contents kept
    again = make_seq("again", PROMPT)
    assert bm.match(again) == 4 and again.block_table == [9, 8] and bm.num_free == 7


@pytest.mark.parametrize("prompt, options, why", [
    (PROMPT[:4], {}, "the prompt is the cached chunk: its last token must still be computed, so no whole chunk"),
    (PROMPT[:3] + [99] + PROMPT[4:], {}, "only the first block matches: half a chunk is no hit"),
    (PROMPT, {"prompt_logprobs": True}, "prompt log-probs need every prompt position's logits"),
])
def test_no_hit(prompt: list[int], options: dict, why: str) -> None:
    bm = BlockManager(num_blocks=10, block_size=2, chunk_size=4)
    a = make_seq("a", PROMPT)
    bm.grow(a, 4)
    bm.cache_chunk(a, 0, 4)
    seq = make_seq("s", prompt, **options)
    assert bm.match(seq) == 0 and seq.block_table == [], why


def test_keys_chain_the_prefix_and_the_adapter() -> None:
    bm = BlockManager(num_blocks=10, block_size=2, chunk_size=4)
    first = (0, (10, 11))
    assert bm.keys(PROMPT, 2) == [first, (hash(first), (12, 13))]
    assert bm.keys(PROMPT, 1, salt="adapter@1") == [(("salt", "adapter@1"), (10, 11))]
    a = make_seq("a", PROMPT)
    bm.grow(a, 4)
    bm.cache_chunk(a, 0, 4)
    assert bm.match(make_seq("lora", PROMPT, lora_key="adapter@1")) == 0  # another adapter's K/V differ


def test_eviction_takes_free_blocks_first_then_the_least_recent_tail() -> None:
    """Freed cached blocks wait, tail first; a take uses never-hashed blocks first, then evicts the least recently
    released (the prefix's tail), so the head stays a hit."""
    bm = BlockManager(num_blocks=4, block_size=2, chunk_size=2)  # blocks 1, 2, 3; a chunk is one block
    a = make_seq("a", PROMPT[:5])
    assert bm.grow(a, 4) and a.block_table == [3, 2]
    bm.cache_chunk(a, 0, 2)
    bm.cache_chunk(a, 2, 4)
    bm.free(a)  # released tail (2) first, then head (3)
    g = make_seq("g", [60, 61, 62])
    assert bm.grow(g, 4) and g.block_table == [1, 2]  # the free block 1, then the evicted tail 2
    assert bm.num_cached == 1
    again = make_seq("again", PROMPT[:5])
    assert bm.match(again) == 2 and again.block_table == [3]  # the head, still cached


def test_pending_key_names_the_next_whole_chunk() -> None:
    bm = BlockManager(num_blocks=10, block_size=2, chunk_size=4)
    a = make_seq("a", PROMPT)
    assert bm.pending_key(a) == bm.keys(PROMPT, 2)[-1]  # chunk [0, 4): its last block's key
    a.num_cached = 4
    assert bm.pending_key(a) == bm.keys(PROMPT, 4)[-1]  # chunk [4, 8)
    a.num_cached = 8
    assert bm.pending_key(a) is None  # [8, 9) is partial
    off = BlockManager(num_blocks=10, block_size=2, chunk_size=4, prefix_caching=False)
    assert off.pending_key(make_seq("b", PROMPT)) is None


def test_prefix_caching_off_never_hashes() -> None:
    bm = BlockManager(num_blocks=10, block_size=2, chunk_size=4, prefix_caching=False)
    a = make_seq("a", PROMPT)
    bm.grow(a, 4)
    bm.cache_chunk(a, 0, 4)
    bm.record_lookup(9, 0)
    assert (bm.num_cached, bm.queried_tokens, bm.match(make_seq("b", PROMPT))) == (0, 0, 0)


def test_pool_blocks_by_count_memory_and_refusal(shared_dir: Path) -> None:
    """stories260K (5 layers, 4 KV heads, head_dim 8): a float32 block of 16 tokens is 2 x 5 x 4 x 16 x 8 x 4 =
    20480 bytes, an int8 one 2 x 5 x 4 x 16 x (8 + 4 for its scale) = 7680."""
    import nexttoken

    model = nexttoken.load(shared_dir / "models" / "stories260k").model
    assert pool_blocks(model, 4, 64, 16, None, 3, torch.float32) == 4  # the null block on top
    assert pool_blocks(model, 4, 64, 16, 5 * 20480 + 1, None, torch.float32) == 6
    assert pool_blocks(model, 4, 64, 16, 5 * 7680, None, torch.int8) == 6
    assert pool_blocks(model, 2, 40, 16, None, None, torch.float32) == 2 * 3 + 1  # max_num_seqs x ceil(40 / 16)
    with pytest.raises(GenerationConfigError, match="at least one block"):
        pool_blocks(model, 4, 64, 16, 20479, None, torch.float32)
