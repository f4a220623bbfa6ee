"""The paged decode reading shared prompt blocks once per group (RolloutConfig.shared_prefix_attention):
the groups the allocator finds, the buffers the step reads, tokens and logprobs equal to the plain
read's (the torch reference on CPU: bit for bit; the Triton kernel in the interpreter and on CUDA:
within fp32 noise), with preemption, EOS, samples and the prefix cache across calls; the KV bytes
the profile counts per step; "auto"'s choice and the settings' checks (tiny fp32 models)."""
from __future__ import annotations

import random
import textwrap

import pytest
import torch
from conftest import get_tiny
from test_paged_attention import HAS_TRITON, run_interpreted

from rollout_lab import Rollout, RolloutConfig
from rollout_lab.engine.kv.paged import BlockAllocator, PagedKVCache
from rollout_lab.measure.models import TINY_VOCAB_SIZE
from rollout_lab.planner.cost import CostCoefficients, ModelGeometry
from rollout_lab.planner.kv_reads import kv_bytes_read

COSTS = CostCoefficients(prefill_fixed_cost_ms=0.05, continuous_decode_cost_ms=0.0)
LENGTHS = [5, 16, 23, 32, 40, 70]  # blocks of 16: none, one, one and a part, two, ..., four and a part
BUDGETS = [9, 20, 3, 14, 6, 12]
SAMPLED = dict(num_samples=3, do_sample=True, temperature=0.9, top_k=40, seed=3, return_logprobs=True)


def make_prompts(lengths, seed=1):
    rng = random.Random(seed)
    return [[rng.randrange(1, TINY_VOCAB_SIZE) for _ in range(n)] for n in lengths]


def run_both(model, prompts, budgets, *, generate, calls=1, **config):
    """The same calls with the shared read off and on (a Rollout each): their results per call."""
    config = dict(mode="paged", kv_block_size=16, costs=COSTS, profile=True) | config
    out = {}
    for read in ("off", "on"):
        rollout = Rollout(model, RolloutConfig(shared_prefix_attention=read, **config))
        out[read] = [rollout.generate(prompts, max_new_tokens=budgets, **generate) for _ in range(calls)]
        assert (rollout.runner.stepper.key.prefix_groups > 0) == (read == "on")
    return out


def test_allocator_groups_rows_by_their_shared_leading_blocks():
    alloc = BlockAllocator(num_blocks=40, num_slots=8, block_size=4, max_blocks_per_row=6)
    alloc.grow(0, 13)  # a 12-token prompt: 3 full blocks and the first step's
    for slot in (1, 2):
        alloc.share(slot, 0, 3)
        alloc.grow(slot, 13)
    alloc.grow(3, 9)  # a prompt of its own: no group
    alloc.grow(4, 9)
    alloc.share(5, 4, 1)  # a sample sharing one block of a second prompt
    alloc.grow(5, 9)
    group_of_row, blocks = alloc.prefix_groups(6, max_groups=4)
    assert group_of_row == [0, 0, 0, -1, 1, 1]
    assert blocks == [alloc.blocks[0][:3], alloc.blocks[4][:1]]
    # a row reading fewer of the head's blocks shrinks its group's prefix (the prefix cache: a chain)
    alloc.release(5)
    alloc.share(5, 0, 2)
    alloc.grow(5, 9)
    group_of_row, blocks = alloc.prefix_groups(6, max_groups=4)
    assert group_of_row == [0, 0, 0, -1, -1, 0] and blocks == [alloc.blocks[0][:2]]  # row 4 reads alone now
    assert alloc.prefix_groups(6, max_groups=0) == ([-1] * 6, [])  # past max_groups: ungrouped
    assert alloc.prefix_groups(1, max_groups=4) == ([-1], [])  # its sharers not among the rows: alone
    before = alloc.version
    alloc.grow(3, 20)  # a row's own growth moves no shared block
    assert alloc.version == before
    alloc.move([5], [6])
    assert alloc.version == before + 1


def test_cache_refreshes_its_group_buffers_only_when_blocks_changed():
    cache = PagedKVCache(num_layers=1, num_slots=4, num_kv_heads=1, head_dim=2, block_size=4, num_blocks=20,
                         max_blocks_per_row=5, dtype=torch.float32, device="cpu", prefix_groups=2)
    cache.grow(0, 9)
    cache.share(1, 0, 8)
    cache.grow(1, 9)
    cache.refresh_prefix_groups(2)
    assert cache.group_of_row.tolist() == [0, 0, -1, -1]
    assert cache.prefix_len.tolist() == [8, 0] and cache.group_rows == [2] and cache.group_tokens == [8]
    assert cache.prefix_blocks[0, :2].tolist() == cache.allocator.blocks[0][:2]
    cache.group_of_row.fill_(5)  # not found again while the blocks stand still
    cache.refresh_prefix_groups(2)
    assert cache.group_of_row.tolist() == [5] * 4
    cache.release([1])
    cache.refresh_prefix_groups(1)
    assert cache.group_of_row.tolist() == [-1] * 4 and cache.prefix_len.tolist() == [0, 0]
    with pytest.raises(ValueError, match="prefix_groups must be"):
        PagedKVCache(num_layers=1, num_slots=4, num_kv_heads=1, head_dim=2, block_size=4, num_blocks=20,
                     max_blocks_per_row=5, dtype=torch.float32, device="cpu", prefix_groups=-1)


@pytest.mark.slow  # two pools, the shared read off and on: about 2 s
def test_shared_read_gives_the_plain_reads_tokens_and_reads_fewer_bytes():
    """Seeded samples with EOS and a stop id on a roomy pool and a tight one (preemption): the torch
    reference of the shared read gives the plain read's tokens and logprobs bit for bit, and the
    profile counts fewer KV bytes per step, by the groups' prefixes read once."""
    model = get_tiny("qwen2")
    prompts = make_prompts(LENGTHS)
    generate = SAMPLED | dict(stop_token_ids=[11])
    for pool in (dict(kv_cache_tokens=1024), dict(continuous_batch_size=6, kv_cache_tokens=160, refill_rows=1)):
        out = run_both(model, prompts, [40] * 6, generate=generate, eos_token_id=7, **pool)
        off, on = out["off"][0], out["on"][0]
        assert on.sequences == off.sequences and on.logprobs == off.logprobs
        assert on.finish_reasons == off.finish_reasons
        assert on.profile.kv_bytes_read_per_step < off.profile.kv_bytes_read_per_step
        if pool["kv_cache_tokens"] == 160:
            assert on.profile.num_preemptions > 0


def test_kv_bytes_read_per_step_counts_each_rows_context():
    """Greedy rows without EOS run in one burst: the plain read's bytes per step are each row's
    context (prompt, tokens so far, the new one) averaged over the steps, and the shared read's
    spare a group's prefix for all but one tile of its rows."""
    model = get_tiny("qwen2")
    geometry = ModelGeometry.from_config(model.config, torch.float32)
    prompts = make_prompts([32, 40])
    out = run_both(model, prompts, 6, generate=dict(num_samples=4), kv_cache_tokens=1024, ignore_eos=True)
    steps = 5  # the first token comes from the prefill
    context = sum(4 * (n + k + 1) for n in (32, 40) for k in range(steps))  # before step k a row holds n + k
    plain = kv_bytes_read(context, geometry) / steps
    shared = kv_bytes_read(context, geometry, prefix_tokens=[32 * steps, 32 * steps], group_rows=[4, 4]) / steps
    assert out["off"][0].profile.kv_bytes_read_per_step == pytest.approx(plain)
    assert out["on"][0].profile.kv_bytes_read_per_step == pytest.approx(shared)
    assert shared < plain


def test_prefix_cache_rows_read_shared_blocks_across_calls():
    """With the prefix cache a second call's prompts read the first call's blocks: the shared read
    still gives the plain read's tokens, call after call."""
    model = get_tiny("llama")
    prompts = make_prompts([40, 70, 23], seed=4)
    out = run_both(model, prompts, [8, 5, 7], generate=SAMPLED, calls=2, kv_cache_tokens=1024, prefix_cache=True)
    for off, on in zip(out["off"], out["on"]):
        assert on.sequences == off.sequences and on.logprobs == off.logprobs
    assert out["on"][1].profile.prefix_cache_hits > 0


def test_auto_reads_shared_where_the_kernel_runs_and_on_needs_shared_blocks():
    model = get_tiny("qwen2")
    rollout = Rollout(model, RolloutConfig(mode="paged", kv_block_size=16))
    groups = [0, 0, 0, 1, 1, 1, 2]
    lengths = [40, 40, 40, 70, 70, 70, 90]
    assert rollout.shared_prefix_groups(lengths, groups, 7, 8) == 0  # CPU without the interpreter: the plain read
    on = Rollout(model, RolloutConfig(mode="paged", kv_block_size=16, shared_prefix_attention="on"))
    assert on.shared_prefix_groups(lengths, groups, 7, 8) == 2  # two prompts with samples
    assert on.shared_prefix_groups(lengths, groups, 3, 8) == 1  # half the slots
    assert on.shared_prefix_groups([8] * 7, groups, 7, 8) == 0  # prompts shorter than a block share none
    assert on.shared_prefix_groups(lengths, list(range(7)), 7, 8) == 0  # no samples
    taken = Rollout(model, RolloutConfig(mode="auto", shared_prefix_attention="on"))
    assert taken.route_for([40] * 4, [8] * 4, groups=[0, 0, 1, 1]) == "paged"


@pytest.mark.parametrize("config, message", [
    (dict(shared_prefix_attention="yes"), r"shared_prefix_attention must be one of \['auto', 'on', 'off'\], got 'yes'"),
    (dict(shared_prefix_attention="on", share_prompt_blocks=False), "turn share_prompt_blocks on"),
    (dict(shared_prefix_attention="on", mode="bucketed"), "mode='bucketed' rule the paged route out"),
    (dict(shared_prefix_attention="on", cache_capacity=64), "cache_capacity rule the paged route out"),
])
def test_shared_prefix_attention_settings_are_checked(config, message):
    with pytest.raises(ValueError, match=message):
        RolloutConfig(**config)


INTERPRETED = textwrap.dedent("""
    import sys
    from test_shared_prefix_decode import LENGTHS, BUDGETS, SAMPLED, get_tiny, make_prompts, run_both
    model = get_tiny("qwen2")
    out = run_both(model, make_prompts(LENGTHS[3:]), BUDGETS[3:], generate=SAMPLED, kv_cache_tokens=1024)
    off, on = out["off"][0], out["on"][0]
    worst = max(abs(a - b) for x, y in zip(off.logprobs, on.logprobs) for a, b in zip(x, y))
    assert on.sequences == off.sequences and worst < 1e-4, worst
    print("decode ok", worst)
""")


@pytest.mark.slow  # the paged and shared-prefix kernels interpreted: about a minute
@pytest.mark.skipif(not HAS_TRITON or torch.cuda.is_available(),
                    reason="needs Triton (make test installs it) on a machine without CUDA")
def test_the_triton_shared_read_gives_the_plain_reads_tokens_in_the_interpreter():
    assert "decode ok" in run_interpreted(INTERPRETED)


@pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON, reason="needs a CUDA GPU and Triton")
@pytest.mark.parametrize("decode", ["eager", "graph"])
def test_cuda_shared_read_gives_the_plain_reads_tokens(decode):
    model = get_tiny("qwen2").to("cuda")
    try:
        out = run_both(model, make_prompts(LENGTHS), BUDGETS, generate=SAMPLED, kv_cache_tokens=1024,
                       decode=decode, calls=2)
    finally:
        model.to("cpu")
    for off, on in zip(out["off"], out["on"]):
        worst = max(abs(a - b) for x, y in zip(off.logprobs, on.logprobs) for a, b in zip(x, y))
        assert on.sequences == off.sequences and worst < 1e-4, worst
