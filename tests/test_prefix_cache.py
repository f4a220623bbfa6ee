"""The prefix cache across calls (RolloutConfig.prefix_cache): a finished prompt's full KV blocks stay
in the paged pool, keyed by a hash chain of their tokens, and a later call's prompt reads its longest
cached chain and prefills only the rest. The allocator's idle LRU (a cached block counts as free and
is taken back only when the free list runs dry); tokens and logprobs equal the calls without the cache
(two and three calls, overlapping prompts, samples, preemption, EOS and stops, prefill across turns)
and a fresh rollout's after the weights change (tiny fp32 models, CPU)."""
from __future__ import annotations

import pytest
import torch

from rollout_lab.engine.kv.paged import SCRATCH_BLOCK, BlockAllocator, PagedKVCache, block_keys


def test_block_keys_chain_the_prefix():
    a, b = block_keys([1, 2, 3, 4, 5, 6, 7], 2), block_keys([1, 2, 3, 4, 9, 9], 2)
    assert len(a) == 3 and len(b) == 3  # full blocks only
    assert a[:2] == b[:2] and a[2] != b[2]
    assert block_keys([3, 4, 1, 2], 2)[1] != a[1]  # a block's key depends on the blocks before it
    assert block_keys([1], 2) == []


def test_cached_blocks_idle_after_their_last_reader_and_taken_back_least_recent_first():
    alloc = BlockAllocator(num_blocks=8, num_slots=3, block_size=4, max_blocks_per_row=4)
    keys = block_keys(list(range(10)), 4)  # a 10-token prompt: two full blocks
    alloc.grow(0, 11)
    assert alloc.blocks[0] == [1, 2, 3]
    alloc.register(0, keys)
    assert alloc.num_cached == 2 and alloc.match(keys) == [1, 2] and alloc.match(block_keys([9] * 8, 4)) == []
    alloc.release(0)
    assert alloc.num_free == 7 and alloc.num_used == 0 and list(alloc.idle) == [2, 1]  # its last block first
    assert alloc.free[-1] == 3
    assert alloc.attach(1, alloc.match(keys[:1])) == [(0, 1)]  # a later prompt reads block 1
    assert alloc.refs[1] == 1 and list(alloc.idle) == [2] and alloc.num_used == 1 and alloc.peak_used == 3
    alloc.grow(1, 16)  # its own blocks: from the free list while it has some
    assert alloc.blocks[1] == [1, 3, 4, 5] and alloc.num_evicted == 0
    alloc.grow(2, 12)  # the free list runs dry: the idle cached block 2 is taken back, its key dropped
    assert alloc.blocks[2] == [6, 7, 2] and alloc.num_evicted == 1 and alloc.match(keys) == [1]
    with pytest.raises(RuntimeError, match="slot 2 needs 1 blocks, 0 are free"):
        alloc.grow(2, 13)
    alloc.attach(0, [1])  # a second reader of a cached block shares it
    assert alloc.refs[1] == 2 and alloc.num_shared == 1 and alloc.extra_refs == 1
    with pytest.raises(RuntimeError, match="block 3 is not in the prefix cache"):
        alloc.release(0) or alloc.attach(0, [3])
    alloc.reset()  # a new call: the slots hold none, the cache stays
    assert alloc.blocks == [[]] * 3 and alloc.refs == [0] * 8 and list(alloc.idle) == [1]
    assert alloc.num_free == 7 and SCRATCH_BLOCK not in alloc.free and 1 not in alloc.free
    assert alloc.num_evicted == 0 and alloc.match(keys) == [1]
    assert alloc.clear_cached() == 1  # the weights changed
    assert alloc.num_cached == 0 and not alloc.idle and alloc.num_free == 7 and alloc.match(keys) == []


def test_register_keeps_the_first_block_of_a_key():
    alloc = BlockAllocator(num_blocks=8, num_slots=2, block_size=2, max_blocks_per_row=4)
    keys = block_keys([5, 6, 7, 8], 2)
    alloc.grow(0, 4)
    alloc.grow(1, 4)
    alloc.register(0, keys)
    alloc.register(1, keys)  # the same prompt prefilled twice: its copy stays uncached
    assert alloc.cached == dict(zip(keys, [1, 2])) and alloc.key_of == {1: keys[0], 2: keys[1]}
    alloc.release(1)
    assert alloc.free[-2:] == [4, 3] and not alloc.idle


def test_gather_reads_the_blocks_kv_and_admit_writes_from_a_start():
    cache = PagedKVCache(num_layers=1, num_slots=2, num_kv_heads=1, head_dim=2, block_size=2, num_blocks=8,
                         max_blocks_per_row=4, dtype=torch.float32, device="cpu")
    keys = torch.arange(5 * 2, dtype=torch.float32).reshape(1, 1, 5, 2)  # [rows, kv_heads, width, head_dim]
    cache.grow(0, 5)
    cache.admit([0], [(keys, -keys)], [5])
    (k, v), = cache.gather(cache.allocator.blocks[0][:2])
    assert torch.equal(k, keys[:, :, :4]) and torch.equal(v, -keys[:, :, :4])
    cache.allocator.register(0, block_keys([1, 2, 3, 4, 5], 2))
    cache.attach(1, cache.allocator.blocks[0][:2])
    cache.grow(1, 6)
    cache.admit([1], [(2 * keys, -2 * keys)], [5], starts=[4])  # only position 4: the rest is cached
    (k, _), = cache.gather(cache.allocator.blocks[1])
    assert torch.equal(k[:, :, :4], keys[:, :, :4]) and torch.equal(k[:, :, 4], 2 * keys[:, :, 4])
    assert cache.block_tables[1, :2].tolist() == cache.block_tables[0, :2].tolist()
