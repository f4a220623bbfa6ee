"""The prefix cache across calls (RolloutConfig.prefix_cache): a finished prompt's full KV blocks stay
in the paged pool, keyed by a hash chain of their tokens, and a later call's prompt reads its longest
cached chain and prefills only the rest. The allocator's idle LRU (a cached block counts as free and
is taken back only when the free list runs dry); tokens and logprobs equal the calls without the cache
(two and three calls, overlapping prompts, samples, preemption, EOS and stops, prefill across turns)
and a fresh rollout's after the weights change (tiny fp32 models, CPU)."""
from __future__ import annotations

import copy
import random

import pytest
import torch
from conftest import get_tiny, one_fast

from rollout_lab import Rollout, RolloutConfig
from rollout_lab.engine.kv.paged import SCRATCH_BLOCK, BlockAllocator, PagedKVCache, block_keys
from rollout_lab.measure.models import TINY_FAMILIES, TINY_VOCAB_SIZE

SAMPLED = dict(do_sample=True, temperature=0.9, top_k=40, seed=7)


def make_prompts(lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(1, TINY_VOCAB_SIZE) for _ in range(n)] for n in lengths]


def cached_and_fresh(model, calls, *, generate, **config):
    """Each call's results with the prefix cache (one Rollout across the calls) and without it (one
    Rollout across them too), their tokens and finish reasons equal and their logprobs within fp32
    noise (a cached prefix's KV came from another forward)."""
    config = dict(mode="paged", kv_block_size=16, profile=True) | config
    cached, fresh = (Rollout(model, RolloutConfig(prefix_cache=on, **config)) for on in (True, False))
    out = []
    for prompts in calls:
        got, want = (r.generate(prompts, return_logprobs=True, **generate) for r in (cached, fresh))
        assert got.sequences == want.sequences
        assert got.finish_reasons == want.finish_reasons
        worst = max((abs(a - b) for g, w in zip(got.logprobs, want.logprobs) for a, b in zip(g, w)), default=0)
        assert worst < 1e-4, worst
        assert want.profile.prefix_cache_hits == 0
        out.append(got)
    return out


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


# -- the engine ------------------------------------------------------------------------------------


# blocks of 16: shorter than a block, one block exactly, one and a part, two exactly, two and a part
LENGTHS = [5, 16, 23, 32, 40]


def hit_tokens(lengths, block_size=16):
    """Prompt tokens a second call of the same prompts reads from the cache: the blocks before each
    prompt's last token."""
    return sum((n - 1) // block_size * block_size for n in lengths)


@pytest.mark.parametrize("family", one_fast(TINY_FAMILIES, "qwen2"))
def test_a_second_and_third_call_read_the_cached_prompts(family, oracle):
    """The same prompts three times, greedy samples: the second and third calls read every full block
    before each prompt's last token from the cache and prefill the rest, with the oracle's tokens."""
    model = get_tiny(family)
    prompts = make_prompts(LENGTHS, seed=1)
    first, second, third = cached_and_fresh(model, [prompts] * 3, generate=dict(max_new_tokens=9, num_samples=2),
                                            kv_cache_tokens=1024)
    assert first.sequences == [oracle.one(model, p, 9, None, 1.0) for p in prompts for _ in range(2)]
    assert first.profile.prefix_cache_hits == 0
    assert second.profile.prefix_cache_hits == third.profile.prefix_cache_hits == hit_tokens(LENGTHS) == 64
    assert second.profile.prefix_cache_evicted_blocks == 0 and second.profile.prefix_cache_dropped is None
    # the prompts with a cached block are prefilled one each over it; 5 and 16 tokens in one bucket
    assert second.profile.num_prefill_forwards == 3 + 1
    assert second.profile.shared_kv_blocks == first.profile.shared_kv_blocks


@pytest.mark.slow  # two sampled calls of 6 rows x 20 tokens, with and without the cache
def test_overlapping_prompts_share_the_system_prompts_blocks():
    """A system prompt of 40 tokens before different questions: the second call's prompts read its
    two full blocks (and a repeated question's own), sampled with a stop id and EOS. The slots and
    the pool are fixed, and the first call's longest row is the longest: a call of other slots, or
    of a row past the kept table's width, would need another pool."""
    system = make_prompts([40], seed=2)[0]
    questions = make_prompts([3, 12, 30, 7], seed=3)
    calls = [[system + q for q in questions[1:3]], [system + q for q in (questions[1], questions[3], questions[0])]]
    first, second = cached_and_fresh(get_tiny("qwen2"), calls, eos_token_id=7, continuous_batch_size=4,
                                     kv_cache_tokens=1024, generate=dict(max_new_tokens=20, num_samples=2,
                                                                         stop_token_ids=[11], **SAMPLED))
    assert second.profile.prefix_cache_hits == 48 + 32 + 32  # questions 12 (its blocks again), 7, 3
    assert second.profile.shared_kv_blocks >= 2  # the system prompt's blocks, read by three prompts' rows


@pytest.mark.slow  # three calls through a pool tight enough to preempt and take cached blocks back
def test_a_tight_pool_takes_cached_blocks_back_and_preempts_as_without_the_cache():
    """A pool of 10 blocks of 16 for 4 slots: rows are preempted and idle cached blocks are taken
    back for their blocks; the tokens and logprobs are those without the cache, call after call."""
    prompts = make_prompts([33, 20, 48, 17, 40], seed=4)
    calls = cached_and_fresh(get_tiny("qwen2"), [prompts, prompts[::-1], prompts], repetition_penalty=1.3,
                             continuous_batch_size=4, kv_cache_tokens=160, refill_rows=1, eos_token_id=7,
                             generate=dict(max_new_tokens=30, num_samples=2, **SAMPLED))
    profiles = [c.profile for c in calls]
    assert sum(p.num_preemptions for p in profiles) > 0
    assert sum(p.prefix_cache_evicted_blocks for p in profiles) > 0
    assert sum(p.prefix_cache_hits for p in profiles) > 0


@pytest.mark.slow  # prompts prefilled in chunks across turns, twice
def test_prefill_across_turns_starts_from_the_cached_blocks():
    """admit_tokens_per_step=16: a long prompt's second call starts its chunks after its cached blocks."""
    prompts = make_prompts([33, 6, 48, 12, 41], seed=5)
    first, second = cached_and_fresh(get_tiny("qwen2"), [prompts, prompts], admit_tokens_per_step=16,
                                     continuous_batch_size=4, generate=dict(max_new_tokens=10, num_samples=2))
    assert second.profile.prefix_cache_hits >= 32 + 32 + 32
    assert second.profile.max_turn_prefill_tokens <= 16
    assert second.profile.num_prefill_forwards < first.profile.num_prefill_forwards


@pytest.mark.parametrize("change", ["in_place", "assign"])
def test_a_weight_change_drops_the_cache(change):
    """Weights written in place (an optimizer step) or replaced (load_state_dict(assign=True))
    between two calls: the second call reads nothing cached and gives a fresh rollout's tokens."""
    model = copy.deepcopy(get_tiny("qwen2"))
    prompts = make_prompts(LENGTHS, seed=6)
    config = RolloutConfig(mode="paged", kv_block_size=16, profile=True, prefix_cache=True)
    rollout = Rollout(model, config)
    before = rollout.generate(prompts, max_new_tokens=12)
    new = {name: t * 1.5 if "k_proj" in name or "v_proj" in name else t for name, t in model.state_dict().items()}
    if change == "in_place":
        with torch.no_grad():
            for name, t in model.state_dict().items():
                t.copy_(new[name])
    else:
        model.load_state_dict({name: t.clone() for name, t in new.items()}, assign=True)
    after = rollout.generate(prompts, max_new_tokens=12)
    want = Rollout(model, RolloutConfig(mode="paged", kv_block_size=16)).generate(prompts, max_new_tokens=12)
    assert after.sequences == want.sequences != before.sequences
    assert after.profile.prefix_cache_hits == 0 and after.profile.prefix_cache_dropped == "weights"
    again = rollout.generate(prompts, max_new_tokens=12)  # the new weights' blocks are cached
    assert again.sequences == want.sequences and again.profile.prefix_cache_hits == hit_tokens(LENGTHS)


def test_a_write_through_data_needs_clear_prefix_cache():
    """``.data`` writes leave no trace on the tensors: the cache stays (stale KV, other tokens) until
    ``clear_prefix_cache``."""
    model = copy.deepcopy(get_tiny("qwen2"))
    prompts = make_prompts(LENGTHS, seed=6)
    rollout = Rollout(model, RolloutConfig(mode="paged", kv_block_size=16, profile=True, prefix_cache=True))
    rollout.generate(prompts, max_new_tokens=12)
    for name, t in model.named_parameters():
        if "k_proj" in name or "v_proj" in name:
            t.data.mul_(1.5)
    want = Rollout(model, RolloutConfig(mode="paged", kv_block_size=16)).generate(prompts, max_new_tokens=12)
    stale = rollout.generate(prompts, max_new_tokens=12)
    assert stale.profile.prefix_cache_hits > 0 and stale.sequences != want.sequences
    assert rollout.clear_prefix_cache() > 0
    assert rollout.generate(prompts, max_new_tokens=12).sequences == want.sequences


def test_a_call_needing_another_pool_drops_the_cache():
    model = get_tiny("qwen2")
    prompts = make_prompts(LENGTHS, seed=7)
    rollout = Rollout(model, RolloutConfig(mode="paged", kv_block_size=16, profile=True, prefix_cache=True,
                                           kv_cache_tokens=1024))
    rollout.generate(prompts, max_new_tokens=4)
    other = rollout.generate(prompts[:2], max_new_tokens=4)  # fewer rows: fewer slots, another pool
    assert other.profile.prefix_cache_dropped == "pool" and other.profile.prefix_cache_hits == 0


def test_auto_takes_paged_with_the_prefix_cache_and_other_modes_are_refused():
    rollout = Rollout(get_tiny("qwen2"), RolloutConfig(prefix_cache=True))
    assert rollout.route_for([5, 6], [4, 4]) == "paged"
    for mode in ("nocb", "bucketed", "aligned", "equal_width", "packed"):
        with pytest.raises(ValueError, match=f"across calls; mode='{mode}' rule the paged route out: use mode='paged' or 'auto'"):
            RolloutConfig(prefix_cache=True, mode=mode)
    with pytest.raises(ValueError, match="prefix_cache keeps prompts' blocks in the paged pool across calls; mode='auto', cache_capacity rule"):
        RolloutConfig(prefix_cache=True, cache_capacity=64)
    with pytest.raises(ValueError, match="prefix_cache must be a bool, got 1"):
        RolloutConfig(prefix_cache=1)
