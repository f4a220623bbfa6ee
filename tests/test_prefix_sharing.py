"""Shared prompt blocks on the paged route (RolloutConfig.share_prompt_blocks): the samples of a
prompt read its full KV blocks instead of each holding a copy. Tokens and logprobs are those of the
copies and of the one-request oracle (samples, prompts shorter, longer and a multiple of a block,
preemption, EOS and stop ids, prefill across turns, greedy and seeded); fewer blocks are held; the
allocator's reference counts; the pool sizing and its replay count a prompt's blocks once (tiny fp32
models, CPU)."""
from __future__ import annotations

import random

import pytest
import torch
from conftest import get_tiny, one_fast

from rollout_lab import Rollout, RolloutConfig
from rollout_lab.engine.kv.paged import SCRATCH_BLOCK, BlockAllocator, PagedKVCache
from rollout_lab.engine.kv.sizing import paged_layout
from rollout_lab.measure.models import TINY_FAMILIES, TINY_VOCAB_SIZE
from rollout_lab.planner.cost import CostCoefficients
from rollout_lab.planner.occupancy import simulate_refill

SPLIT_COSTS = CostCoefficients(prefill_fixed_cost_ms=0.05, continuous_decode_cost_ms=0.0)
# blocks of 16: a prompt shorter than a block, one and two blocks exactly, one and two and a part
LENGTHS = [5, 16, 23, 32, 40]
SAMPLED = dict(do_sample=True, temperature=0.9, top_k=40, seed=7, return_logprobs=True)


def make_prompts(lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(1, TINY_VOCAB_SIZE) for _ in range(n)] for n in lengths]


def run(model, prompts, max_new_tokens, *, generate=None, **config):
    config = dict(mode="paged", kv_block_size=16, costs=SPLIT_COSTS, profile=True) | config
    return Rollout(model, RolloutConfig(**config)).generate(prompts, max_new_tokens=max_new_tokens,
                                                            **(generate or {}))


def shared_and_copied(model, prompts, max_new_tokens, *, generate=None, **config):
    """(the call with shared prompt blocks, the same with a copy per sample), their tokens equal and
    their logprobs within fp32 noise (the two may admit rows in different turns)."""
    shared, copied = (run(model, prompts, max_new_tokens, generate=generate, share_prompt_blocks=share, **config)
                      for share in (True, False))
    assert shared.sequences == copied.sequences
    assert shared.finish_reasons == copied.finish_reasons
    if shared.logprobs is not None:
        worst = max((abs(a - b) for g, w in zip(shared.logprobs, copied.logprobs) for a, b in zip(g, w)), default=0)
        assert worst < 1e-4, worst
    return shared, copied


@pytest.mark.parametrize("family", one_fast(TINY_FAMILIES, "qwen2"))
def test_samples_read_their_prompts_blocks_with_the_oracles_tokens(family, oracle):
    """Greedy samples of prompts around the block size: the oracle's tokens, every row at once (a
    roomy pool); the full prompt blocks held once (a prompt of 32 shares both its blocks, one of 5
    none), so the peak of blocks and of distinct tokens drops by two copies of them."""
    model = get_tiny(family)
    prompts = make_prompts(LENGTHS, seed=1)
    budgets = [9, 20, 3, 14, 6]
    shared, copied = shared_and_copied(model, prompts, budgets, generate=dict(num_samples=3), kv_cache_tokens=1024)
    expected = [oracle.one(model, p, b, None, 1.0) for p, b in zip(prompts, budgets)]
    assert shared.sequences == [s for s in expected for _ in range(3)]
    full = sum(n // 16 for n in LENGTHS)  # 0 + 1 + 1 + 2 + 2 blocks, each read by 3 samples
    prof, base = shared.profile, copied.profile
    assert prof.shared_kv_blocks == full and base.shared_kv_blocks == 0
    assert prof.peak_kv_blocks == base.peak_kv_blocks - 2 * full
    assert prof.unique_kv_tokens == prof.peak_live_tokens - 2 * 16 * full
    assert base.unique_kv_tokens == base.peak_live_tokens


@pytest.mark.slow  # sampled rows through a tight pool and a roomy one, shared and copied, and the aligned route
def test_preemption_eos_and_stop_ids_with_seeded_samples():
    """Seeded samples with EOS, a stop id and the penalty: shared blocks give the copies' tokens and
    logprobs (and the aligned route's), on a pool tight enough to preempt (a preempted sample gives
    its references back and returns into blocks of its own) and on a roomy one."""
    model = get_tiny("qwen2")
    prompts = make_prompts(LENGTHS, seed=2)
    common = dict(repetition_penalty=1.3, eos_token_id=7)
    sample = SAMPLED | dict(num_samples=3, stop_token_ids=[11])
    want = run(model, prompts, 40, mode="bucketed", generate=sample, **common)
    assert len({len(s) for s in want.sequences}) >= 3 and want.finish_reasons.count("stop") >= 3
    for config in (dict(continuous_batch_size=4, kv_cache_tokens=128), dict()):
        shared, copied = shared_and_copied(model, prompts, 40, generate=sample, **common, **config)
        assert shared.sequences == want.sequences and shared.finish_reasons == want.finish_reasons
        worst = max(abs(a - b) for g, w in zip(shared.logprobs, want.logprobs) for a, b in zip(g, w))
        assert worst < 1e-4, worst
        assert shared.profile.shared_kv_blocks > 0
        if config:
            assert shared.profile.num_preemptions > 0


@pytest.mark.slow  # the oracle and a paged run of 6 rows x 30 tokens
def test_greedy_samples_preempted_keep_the_oracles_tokens(oracle):
    """A pool of 6 blocks for 3 slots: samples sharing their prompt's blocks are preempted and come
    back, and every row keeps the oracle's tokens."""
    model = get_tiny("opt")
    prompts = make_prompts([32, 23, 16], seed=3)
    got = run(model, prompts, 30, generate=dict(num_samples=2), continuous_batch_size=3, kv_cache_tokens=96,
              refill_rows=1, ignore_eos=True)
    assert got.sequences == [oracle.one(model, p, 30, None, 1.0) for p in prompts for _ in range(2)]
    assert got.profile.num_preemptions > 0 and got.profile.shared_kv_blocks > 0


@pytest.mark.slow  # prompts prefilled in chunks across turns, sampled, shared and copied, and the aligned route
def test_prefill_across_turns_shares_the_prompt_with_the_samples_behind_it(oracle):
    """admit_tokens_per_step: a prompt longer than the bound is prefilled across turns and enters with
    its samples (``_enter_prefilled``), which read its full blocks; the copies' tokens and logprobs,
    the aligned route's, and greedy the oracle's."""
    model = get_tiny("qwen2")
    prompts = make_prompts([33, 6, 48, 12, 41], seed=4)
    sample = SAMPLED | dict(num_samples=2)
    want = run(model, prompts, 16, mode="bucketed", generate=sample)
    shared, _ = shared_and_copied(model, prompts, 16, generate=sample, admit_tokens_per_step=16,
                                  continuous_batch_size=6)
    assert shared.sequences == want.sequences
    assert shared.profile.max_turn_prefill_tokens <= 16
    assert shared.profile.shared_kv_blocks >= 3  # the 48-token prompt, split, and its sample
    greedy, _ = shared_and_copied(model, prompts, 10, generate=dict(num_samples=2), admit_tokens_per_step=16,
                                  continuous_batch_size=4)
    assert greedy.sequences == [oracle.one(model, p, 10, None, 1.0) for p in prompts for _ in range(2)]
    assert {r for plan in greedy.plans for r, _ in plan.chunks} >= {0, 2, 4}


def test_block_allocator_reference_counts():
    alloc = BlockAllocator(num_blocks=10, num_slots=4, block_size=4, max_blocks_per_row=4)
    assert [b for _, b in alloc.grow(0, 10)] == [1, 2, 3]
    assert alloc.share(1, 0, 2) == [(0, 1), (1, 2)]  # the two full blocks of a 10-token prompt
    assert alloc.grow(1, 11) == [(2, 4)]  # its own block for the rest
    alloc.share(2, 0, 2)
    alloc.grow(2, 9)
    assert alloc.blocks == [[1, 2, 3], [1, 2, 4], [1, 2, 5], []]
    assert alloc.num_used == alloc.peak_used == 5 and alloc.num_shared == alloc.peak_shared == 2
    assert alloc.extra_refs == 4 and alloc.refs[1] == alloc.refs[2] == 3
    alloc.release(0)  # the first reader leaves: only its own block goes back
    assert alloc.free[-1] == 3 and alloc.num_used == 4 and alloc.refs[1] == 2 and alloc.extra_refs == 2
    alloc.move([2], [0])  # compaction: the references move with the slot
    assert alloc.blocks[0] == [1, 2, 5] and alloc.blocks[2] == [] and alloc.refs[1] == 2
    alloc.release(1)
    assert alloc.num_shared == alloc.extra_refs == 0 and alloc.peak_shared == 2 and alloc.free[-1] == 4
    alloc.release(0)  # the last reader: its blocks go back, in the order grow hands them out again
    assert alloc.num_free == 9 and alloc.free[-3:] == [5, 2, 1] and SCRATCH_BLOCK not in alloc.free
    assert [b for _, b in alloc.grow(3, 8)] == [1, 2]
    with pytest.raises(RuntimeError, match="slot 3 still holds blocks"):
        alloc.share(3, 3, 1)
    with pytest.raises(RuntimeError, match="slot 3 holds 2 blocks, fewer than the 3 slot 0 would share"):
        alloc.share(0, 3, 3)
    alloc.share(0, 3, 2)
    alloc.reset()
    assert alloc.num_free == 9 and alloc.refs == [0] * 10 and alloc.peak_used == alloc.peak_shared == 0
    assert alloc.num_shared == alloc.extra_refs == 0 and alloc.blocks == [[]] * 4


def test_share_points_at_the_full_blocks_and_copy_positions_fills_the_partial_one():
    cache = PagedKVCache(num_layers=2, num_slots=2, num_kv_heads=1, head_dim=2, block_size=2, num_blocks=8,
                         max_blocks_per_row=4, dtype=torch.float32, device="cpu")
    cache.grow(0, 6)  # a 5-token prompt and the first step
    keys = torch.arange(5 * 2, dtype=torch.float32).reshape(1, 1, 5, 2)  # [rows, kv_heads, width, head_dim]
    cache.admit([0], [(keys, -keys), (2 * keys, -2 * keys)], [5])
    cache.share(1, 0, 5)
    cache.grow(1, 6)
    cache.copy_positions([1], [0], [4], [5])
    table = cache.block_tables
    assert table[1, :2].tolist() == table[0, :2].tolist() and table[1, 2] != table[0, 2]
    for layer, scale in ((0, 1), (1, 2)):
        for pool, sign in ((cache.keys[layer], 1), (cache.values[layer], -1)):
            block = int(table[1, 2])
            assert torch.equal(pool[block, 0, 0], sign * scale * keys[0, 0, 4])
    assert cache.allocator.num_used == 4  # 3 blocks of slot 0, one of slot 1's own


def test_paged_layout_counts_a_groups_prompt_blocks_once():
    """Four prompts of 40 tokens x 4 samples and 24 new tokens in blocks of 16: a row holds 4 blocks,
    2 of them its prompt's full blocks; shared, a group holds 2 + 4 x 2 = 10 blocks instead of 16,
    so a memory budget of 40 blocks (and the scratch block) runs 16 rows at once, not 10."""
    lengths, budgets = [40] * 16, [24] * 16
    groups = [i // 4 * 4 for i in range(16)]
    common = dict(block_size=16, kv_bytes_per_token=1, refill_rows=lambda slots: 1)
    every = paged_layout(lengths, budgets, budget_bytes=lambda slots: None, **common)
    shared = paged_layout(lengths, budgets, budget_bytes=lambda slots: None, groups=groups, **common)
    assert (every.max_blocks, shared.max_blocks) == (16 * 4 + 1, 4 * 10 + 1)
    bound = dict(budget_bytes=lambda slots: 41 * 16.0, **common)
    assert paged_layout(lengths, budgets, **bound).num_slots == 10
    assert paged_layout(lengths, budgets, groups=groups, **bound).num_slots == 16


@pytest.mark.slow  # 24 rows of up to 60 + 50 tokens
def test_the_engine_peaks_at_the_replays_blocks_with_shared_prompts():
    """Every row at once, no EOS: the pool is the replay's peak with each cohort's prompt blocks held
    once (``simulate_refill(groups=...)``) plus a block per slot, and the engine peaks at exactly that."""
    model = get_tiny("qwen2")
    rng = random.Random(5)
    lengths = [rng.randint(10, 60) for _ in range(8)]
    budgets = [rng.randint(4, 50) for _ in range(8)]
    prompts = make_prompts(lengths, seed=6)
    result = run(model, prompts, budgets, generate=dict(num_samples=3), ignore_eos=True, costs=SPLIT_COSTS)
    rows = [n for n in lengths for _ in range(3)]
    row_budgets = [b for b in budgets for _ in range(3)]
    groups = [3 * (i // 3) for i in range(24)]
    replay = simulate_refill(rows, row_budgets, row_budgets, num_slots=24, layout="paged", block_size=16,
                             read_interval=max(budgets), groups=groups)
    alone = simulate_refill(rows, row_budgets, row_budgets, num_slots=24, layout="paged", block_size=16,
                            read_interval=max(budgets))
    prof = result.profile
    assert prof.num_preemptions == 0 and prof.num_slots == 24
    assert prof.peak_kv_blocks == replay.peak_blocks < alone.peak_blocks
    assert prof.num_kv_blocks - 1 == replay.peak_blocks + 24


@pytest.mark.parametrize("seed", one_fast([0, 1, 2, 4, 9, 11], 4))  # 4 and 11 preempt
def test_pool_replay_with_groups_equals_the_paged_engine(seed):
    """A pool too small for every row, samples sharing their prompt's blocks: the replay's decode
    steps, row-steps and preemptions are the engine's."""
    rng = random.Random(seed)
    n, samples, slots = rng.randint(3, 6), rng.randint(2, 3), rng.randint(3, 6)
    prompts = [rng.choice([rng.randint(1, 40), 16, 32]) for _ in range(n)]
    budgets = [rng.randint(2, 30) for _ in range(n)]
    need = max(-(-(p + b) // 16) for p, b in zip(prompts, budgets))
    pool = need + rng.randint(1, 3)
    rows = [p for p in prompts for _ in range(samples)]
    row_budgets = [b for b in budgets for _ in range(samples)]
    groups = [samples * (i // samples) for i in range(len(rows))]
    sim = simulate_refill(rows, row_budgets, row_budgets, num_slots=slots, layout="paged", pool_blocks=pool,
                          block_size=16, read_interval=max(budgets), groups=groups)
    ids = [[rng.randrange(3, 200) for _ in range(p)] for p in prompts]
    result = Rollout(get_tiny("qwen2"), RolloutConfig(
        mode="paged", kv_block_size=16, continuous_batch_size=slots, kv_cache_tokens=pool * 16, refill_rows=1,
        ignore_eos=True, profile=True)).generate(ids, max_new_tokens=budgets, num_samples=samples)
    prof = result.profile
    assert (prof.num_decode_forwards, prof.num_preemptions) == (sim.steps, sim.preemptions)
    assert prof.decode_row_steps == sim.row_steps


def test_groups_need_the_paged_layout_and_one_per_row():
    with pytest.raises(ValueError, match="groups share the paged pool's prompt blocks; layout 'aligned' has no"):
        simulate_refill([4, 4], [2, 2], [2, 2], num_slots=2, layout="aligned", groups=[0, 0])
    with pytest.raises(ValueError, match="one group per prompt: 2 prompts, 1 groups"):
        simulate_refill([4, 4], [2, 2], [2, 2], num_slots=2, layout="paged", groups=[0])


def test_share_prompt_blocks_must_be_a_bool():
    with pytest.raises(ValueError, match="share_prompt_blocks must be a bool, got 'yes'"):
        RolloutConfig(share_prompt_blocks="yes")
    assert RolloutConfig().share_prompt_blocks is True
