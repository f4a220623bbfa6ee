"""The paged route (engine.kv.paged, engine.sched.paged): the tokens of the one-request oracle
with refill, EOS, a pool small enough to preempt, the penalty, budgets, samples and logprobs; block
bookkeeping; occupancy against the aligned cache; errors before any work (tiny fp32 models, CPU)."""
from __future__ import annotations

import math
import random

import pytest
import torch
from conftest import CharTokenizer, get_tiny, one_fast

from rollout_lab import Rollout, RolloutConfig
from rollout_lab.engine.kv.paged import SCRATCH_BLOCK, BlockAllocator, PagedKVCache
from rollout_lab.measure.models import TINY_FAMILIES, TINY_VOCAB_SIZE
from rollout_lab.planner.cost import CostCoefficients

SPLIT_COSTS = CostCoefficients(prefill_fixed_cost_ms=0.05, continuous_decode_cost_ms=0.0)
LENGTHS = [7, 2, 15, 1, 9, 4, 11, 20, 3, 6]
# 3 slots and a pool of 5 blocks of 16: rows of up to 20 + 30 tokens must wait, grow and be preempted
TIGHT = dict(mode="paged", kv_block_size=16, continuous_batch_size=3, kv_cache_tokens=80, refill_rows=1)


def make_prompts(lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(1, TINY_VOCAB_SIZE) for _ in range(n)] for n in lengths]


def run(model, prompts, max_new_tokens, *, generate=None, **config):
    config.setdefault("costs", SPLIT_COSTS)
    config.setdefault("profile", True)
    return Rollout(model, RolloutConfig(**config)).generate(prompts, max_new_tokens=max_new_tokens, **(generate or {}))


@pytest.mark.parametrize("family", one_fast(TINY_FAMILIES, "opt"))
def test_preemption_keeps_the_oracles_tokens(family, oracle):
    model = get_tiny(family)
    prompts = make_prompts(LENGTHS, seed=1)
    budgets = [30, 3, 25, 30, 1, 28, 5, 30, 7, 26]
    expected = [oracle.one(model, p, b, None, 1.0) for p, b in zip(prompts, budgets)]
    result = Rollout(model, RolloutConfig(costs=SPLIT_COSTS, profile=True, **TIGHT)).generate(
        prompts, max_new_tokens=budgets)
    assert result.sequences == expected
    assert result.route == "paged"
    prof = result.profile
    assert prof.num_preemptions > 0, "the tight pool must preempt"
    assert prof.peak_kv_blocks <= prof.num_kv_blocks - 1  # the scratch block is never handed out
    assert 0 < prof.occupancy <= 1 and prof.num_slots == 3


def eos_case(model, prompts, oracle):
    """(eos, the oracle's tokens): the EOS id most rows meet in their first 15 tokens of 30, with
    the penalty 1.3, so rows end at many lengths."""
    free = oracle(model, prompts, max_new_tokens=30, repetition_penalty=1.3)
    eos = max(range(1, TINY_VOCAB_SIZE), key=lambda t: sum(t in s[:15] for s in free))
    return eos, oracle(model, prompts, max_new_tokens=30, eos_token_id=eos, repetition_penalty=1.3)


@pytest.mark.slow  # rows of up to 20 + 30 tokens through the oracle and four routes
def test_preemption_with_eos_penalty_and_sampling(oracle):
    model = get_tiny("qwen2")
    prompts = make_prompts(LENGTHS, seed=2)
    eos, expected = eos_case(model, prompts, oracle)
    assert len({len(s) for s in expected}) >= 2
    tight = run(model, prompts, 30, eos_token_id=eos, repetition_penalty=1.3, **(TIGHT | dict(kv_cache_tokens=64)))
    assert tight.sequences == expected and tight.profile.num_preemptions > 0
    assert tight.finish_reasons == ["stop" if s[-1] == eos else "length" for s in expected]
    # seeded sampling, samples and logprobs: the aligned route's tokens, preempted or not
    sample = dict(do_sample=True, temperature=0.9, top_k=40, top_p=0.9, seed=7, num_samples=2,
                  return_logprobs=True)
    want = run(model, prompts, 30, mode="bucketed", repetition_penalty=1.3, generate=sample)
    preemptions = []
    for config in (TIGHT, dict(mode="paged", kv_block_size=16)):
        got = run(model, prompts, 30, repetition_penalty=1.3, generate=sample, **config)
        assert got.sequences == want.sequences
        worst = max(abs(a - b) for g, w in zip(got.logprobs, want.logprobs) for a, b in zip(g, w))
        assert worst < 1e-4, worst
        preemptions.append(got.profile.num_preemptions)
    assert preemptions[0] > 0 and preemptions[1] == 0


@pytest.mark.slow  # about 1 s on 2 CPU cores: make test runs it
@pytest.mark.parametrize("mode", one_fast(["paged", "bucketed"], "bucketed"))
def test_without_stops_the_host_reads_each_burst_after_queueing_the_next(mode, oracle, monkeypatch):
    """No EOS or stop strings: a burst's tokens are read only once the next burst is queued (the
    host never waits on the device between bursts), with refill and preemption (paged), the penalty,
    samples and logprobs; the tokens are the oracle's, and sampled ones with their logprobs those of
    a call that reads every burst at once (stop strings that never match force that)."""
    from rollout_lab.engine.sched.aligned import ContinuousBatcher
    from rollout_lab.engine.runner.steppers import EagerStepper

    events = []  # ("step",), ("sent", burst), ("read", burst)
    send, read, step = ContinuousBatcher._send_burst, ContinuousBatcher._read_burst, EagerStepper.step

    def sending(self, tokens, logprobs):
        kept = send(self, tokens, logprobs)
        events.append(("sent", id(self._in_flight)))
        return kept

    def reading(self):
        if self._in_flight is not None:
            events.append(("read", id(self._in_flight)))
        return read(self)

    def stepping(self, num_rows, front):
        events.append(("step",))
        return step(self, num_rows, front)

    monkeypatch.setattr(ContinuousBatcher, "_send_burst", sending)
    monkeypatch.setattr(ContinuousBatcher, "_read_burst", reading)
    monkeypatch.setattr(EagerStepper, "step", stepping)

    def late_reads():
        """(bursts sent, bursts read, bursts read after a later burst's steps were queued)."""
        sent, late = {}, 0
        for i, event in enumerate(events):
            if event[0] == "sent":
                sent[event[1]] = i
            elif event[0] == "read":
                late += any(e == ("step",) for e in events[sent.pop(event[1]) : i])
        reads = sum(e[0] == "read" for e in events)
        return sum(e[0] == "sent" for e in events), reads, late

    model = get_tiny("qwen2")
    prompts = make_prompts(LENGTHS, seed=3)
    budgets = [3, 1, 7, 5, 30, 12, 25, 30, 28, 30]
    config = TIGHT | dict(kv_cache_tokens=64) if mode == "paged" else dict(mode=mode)  # every row at once
    expected = [oracle.one(model, p, b, None, 1.3) for p, b in zip(prompts, budgets)]
    got = run(model, prompts, budgets, repetition_penalty=1.3, **config)
    assert got.sequences == expected
    assert mode != "paged" or got.profile.num_preemptions > 0
    # every burst is read once; once the queue has drained, after the next burst's steps were queued
    # (while rows wait, an admission turn reads it first: a resuming row needs its tokens)
    sent, reads, late = late_reads()
    assert sent > 5 and reads == sent and late >= 3, (sent, reads, late)
    sample = dict(do_sample=True, temperature=0.9, top_k=40, seed=7, num_samples=2, return_logprobs=True)
    late = run(model, prompts, budgets, repetition_penalty=1.3, generate=sample, **config)
    events.clear()
    # a stop string no row can make (the pieces are a, b, # and newlines) reads every token at once
    at_once = Rollout(model, RolloutConfig(costs=SPLIT_COSTS, repetition_penalty=1.3, **config),
                      tokenizer=CharTokenizer()).generate(prompts, max_new_tokens=budgets, stop=["zz"], **sample)
    assert late_reads() == (0, 0, 0)
    assert late.sequences == at_once.sequences
    worst = max(abs(a - b) for g, w in zip(late.logprobs, at_once.logprobs) for a, b in zip(g, w))
    assert worst < 1e-5, worst


EVERY_FEW_STEPS = {"paged": TIGHT | dict(kv_cache_tokens=64), "bucketed": dict(mode="bucketed", continuous_batch_size=3)}


@pytest.mark.slow  # about 3 s on 2 CPU cores, the slowest of make test-fast: make test runs it
@pytest.mark.parametrize("interval", one_fast([4, 7], 4))
@pytest.mark.parametrize("route", one_fast(list(EVERY_FEW_STEPS), "bucketed"))
def test_reading_tokens_every_few_steps_keeps_the_oracles_tokens(interval, route, oracle):
    """eos_check_interval: rows ending at EOS inside an interval compute its other steps, which are
    not theirs; tokens, logprobs and finish reasons are those of a read after every step (paged with
    preemption and the penalty, bucketed; greedy against the oracle, sampled with logprobs), with
    fewer reads of the device."""
    model = get_tiny("qwen2")
    prompts = make_prompts(LENGTHS, seed=2)
    eos, expected = eos_case(model, prompts, oracle)
    assert len({len(s) for s in expected}) >= 3
    sample = dict(do_sample=True, temperature=0.9, top_k=40, seed=7, num_samples=2, return_logprobs=True)
    common = dict(eos_token_id=eos, repetition_penalty=1.3, **EVERY_FEW_STEPS[route])
    every = run(model, prompts, 30, eos_check_interval=1, **common)
    spaced = run(model, prompts, 30, eos_check_interval=interval, **common)
    assert spaced.sequences == every.sequences == expected
    assert spaced.finish_reasons == every.finish_reasons
    reads = [sum(f["kind"] == "decode" for f in r.profile.forwards) for r in (every, spaced)]
    assert reads[1] < reads[0], reads
    drawn = [run(model, prompts, 30, eos_check_interval=i, generate=sample, **common) for i in (1, interval)]
    assert drawn[0].sequences == drawn[1].sequences and drawn[0].finish_reasons == drawn[1].finish_reasons
    assert [len(x) for x in drawn[0].logprobs] == [len(x) for x in drawn[1].logprobs]
    worst = max(abs(a - b) for g, w in zip(drawn[0].logprobs, drawn[1].logprobs) for a, b in zip(g, w))
    assert worst < 1e-4, worst
    assert Rollout(model).eos_check_interval == 1  # "auto" off a captured step: a read after every step


@pytest.mark.slow  # 24 rows of 40 tokens through the one-request oracle
def test_paged_refills_where_the_aligned_cache_waits(oracle):
    """Rows stop at EOS: the aligned cache reserves every admitted row's whole budget right of the
    shared front, so a long row blocks refill; the paged cache admits as slots free up."""
    model = get_tiny("llama")
    prompts = make_prompts([12] * 24, seed=3)
    free = oracle(model, prompts, max_new_tokens=40)
    # EOS ids that end most rows at their 6th token or earlier, not row 0 (the long tail) nor a
    # row's first three tokens (a row that ends at its prefill never decodes)
    eos = sorted({s[5] for s in free[1:]} - set(free[0]) - {t for s in free[1:] for t in s[:3]})
    expected = oracle(model, prompts, max_new_tokens=40, eos_token_id=eos)
    lengths = sorted(map(len, expected))
    assert len(expected[0]) == 40 and lengths[0] >= 4 and lengths[12] <= 6, lengths
    aligned = run(model, prompts, 40, mode="bucketed", eos_token_id=eos, continuous_batch_size=4)
    paged = run(model, prompts, 40, mode="paged", eos_token_id=eos, continuous_batch_size=4, kv_block_size=16,
                refill_rows=1)
    assert paged.sequences == aligned.sequences == expected
    # measured: 78 steps at 92% of the slots against 171 at 42%
    assert paged.profile.num_decode_forwards < 0.6 * aligned.profile.num_decode_forwards
    assert paged.profile.occupancy > 0.85 > 0.5 > aligned.profile.occupancy
    assert paged.profile.queued_occupancy == 1.0  # every slot busy until the queue drained


@pytest.mark.slow  # three paged runs and the oracle
def test_admit_tokens_per_step_bounds_each_turns_prefill(oracle):
    """Refill with admit_tokens_per_step=40: every admission turn prefills at most 40 prompt tokens
    (the 45- and 90-token prompts across turns, in chunks between decode steps), with the oracle's
    tokens; unbounded, refill prefills more in one turn and takes fewer turns."""
    model = get_tiny("qwen2")
    lengths = [30, 25, 7, 12, 45, 9, 18, 22, 5, 90, 14, 8]
    prompts = make_prompts(lengths, seed=5)
    budgets = [6, 20, 9, 4, 12, 7, 15, 5, 10, 8, 3, 11]
    expected = [oracle.one(model, p, b, None, 1.0) for p, b in zip(prompts, budgets)]
    common = dict(mode="paged", continuous_batch_size=4, kv_block_size=16, refill_rows=4)
    bounded = run(model, prompts, budgets, admit_tokens_per_step=40, **common)
    free = run(model, prompts, budgets, **common)
    assert bounded.sequences == free.sequences == expected
    # the longest stall of live rows: within the bound; unbounded with refill_rows=1, the 90-token
    # prompt comes in while rows wait for it (with 4 of 4 slots to refill, nothing is live then)
    assert 0 < bounded.profile.max_turn_prefill_tokens <= 40 and free.profile.max_turn_prefill_tokens == 0
    assert run(model, prompts, budgets, **(common | dict(refill_rows=1))).profile.max_turn_prefill_tokens >= 90
    turns = [[r for bucket in plan.buckets for r in bucket] for plan in bounded.plans]
    assert sorted(r for turn in turns for r in turn) == list(range(len(prompts)))
    split = {r: tail for plan in bounded.plans for r, tail in plan.chunks}
    assert split == {4: (5,), 9: (40, 10)}  # 45 = 40 + 5, 90 = 40 + 40 + 10
    assert all(sum(lengths[r] for r in turn) <= 40 for turn in turns if not set(turn) & set(split)), turns
    # each chunk of a long prompt is its own forward, a decode step between two of them
    kinds = [f["kind"] for f in bounded.profile.forwards]
    assert kinds.count("chunk") == 3 and all(kinds[i - 1] == "decode" for i, k in enumerate(kinds) if k == "chunk")
    # a turn after every step while a prompt is between chunks or queued rows could fill free
    # slots; unbounded, the decode runs in bursts to the nearest budget
    bursts = [f["steps"] for f in bounded.profile.forwards if f["kind"] == "decode"]
    assert max(bursts[: len(bursts) // 2]) == 1 and max(f["steps"] for f in free.profile.forwards
                                                          if f["kind"] == "decode") > 1
    assert len(bounded.plans) > len(free.plans)


def test_auto_takes_paged_when_rows_refill_under_an_admission_bound():
    """Only the paged route bounds an admission's prefill: Auto with the bound set takes it when
    rows refill, and prices the routes as usual when every row fits at once (nothing is live during
    the one admission)."""
    model = get_tiny("qwen2")
    prompts = make_prompts([12, 30, 7, 20, 16, 9], seed=6)
    bounded = run(model, prompts, 8, costs=SPLIT_COSTS, continuous_batch_size=2, admit_tokens_per_step=16)
    assert bounded.route == "paged" and bounded.profile.max_turn_prefill_tokens <= 16
    assert run(model, prompts, 8, costs=SPLIT_COSTS, continuous_batch_size=2).route != "paged"
    assert run(model, prompts, 8, costs=SPLIT_COSTS, admit_tokens_per_step=16).route != "paged"
    assert bounded.sequences == run(model, prompts, 8, mode="bucketed").sequences


@pytest.mark.slow  # sampled rows of up to 70 + 30 tokens on three routes
def test_prefill_across_turns_keeps_tokens_with_samples_penalty_eos_and_logprobs(oracle):
    """Prompts longer than the bound, each with two samples sharing its KV: the aligned route's
    tokens and logprobs with the penalty, EOS and seeded sampling, on a pool tight enough to
    preempt and on a roomy one; nothing live while a long prompt's chunks run at the start."""
    model = get_tiny("qwen2")
    prompts = make_prompts([33, 6, 70, 12, 41, 3], seed=8)
    eos, _ = eos_case(model, prompts, oracle)
    sample = dict(do_sample=True, temperature=0.9, top_k=40, seed=3, num_samples=2, return_logprobs=True)
    common = dict(repetition_penalty=1.3, eos_token_id=eos)
    want = run(model, prompts, 30, mode="bucketed", generate=sample, **common)
    preempted = []
    for config in (dict(mode="paged", kv_block_size=16, continuous_batch_size=3, kv_cache_tokens=160),
                   dict(mode="paged", kv_block_size=16, continuous_batch_size=5)):
        got = run(model, prompts, 30, admit_tokens_per_step=16, generate=sample, **common, **config)
        assert got.sequences == want.sequences and got.finish_reasons == want.finish_reasons
        worst = max(abs(a - b) for g, w in zip(got.logprobs, want.logprobs) for a, b in zip(g, w))
        assert worst < 1e-4, worst
        assert got.profile.max_turn_prefill_tokens <= 16
        preempted.append((got.profile.num_preemptions, got.profile.num_replicated_rows))
    # the tight pool preempts; on the roomy one each split prompt's second sample enters with it
    # (one prefill, its KV replicated: 3 long prompts)
    assert preempted[0][0] > 0 and preempted[1] == (0, 3), preempted
    # greedy against the one-request oracle, the first prompt split
    greedy = run(model, prompts, 12, mode="paged", kv_block_size=16, continuous_batch_size=2, admit_tokens_per_step=10)
    assert greedy.sequences == [oracle.one(model, p, 12, None, 1.0) for p in prompts]
    assert {r for plan in greedy.plans for r, _ in plan.chunks} == {0, 2, 3, 4}


def test_auto_goes_paged_when_every_row_at_once_would_not_fit_the_memory(monkeypatch):
    """RolloutConfig() runs every row at once; when that cache is over the device's KV budget
    (``_kv_budget_bytes``, CUDA only: faked here) Auto takes the paged route, whose pool picks the
    slots, instead of allocating past the memory. The tokens are the aligned route's."""
    model = get_tiny("qwen2")
    prompts = make_prompts([12, 30, 7, 20, 16, 9], seed=6)
    rollout = Rollout(model, RolloutConfig(costs=SPLIT_COSTS))
    assert rollout.kv_budget_bytes(6) is None  # off CUDA: no bound
    per_token = rollout.geometry.kv_bytes_per_token
    all_at_once = 6 * (30 + 10) * per_token
    monkeypatch.setattr(rollout, "kv_budget_bytes", lambda num_slots: all_at_once - 1.0)
    tight = rollout.generate(prompts, max_new_tokens=10)
    monkeypatch.setattr(rollout, "kv_budget_bytes", lambda num_slots: float(all_at_once))
    roomy = rollout.generate(prompts, max_new_tokens=10)
    assert tight.route == "paged" and roomy.route != "paged"
    aligned = Rollout(model, RolloutConfig(mode="bucketed")).generate(prompts, max_new_tokens=10)
    assert tight.sequences == roomy.sequences == aligned.sequences


def test_default_slots_hold_every_row_on_cpu():
    model = get_tiny("qwen3")
    prompts = make_prompts([5, 9, 3, 30], seed=4)
    result = run(model, prompts, 6, mode="paged", kv_block_size=16)
    assert result.profile.num_slots == 4 and result.profile.num_preemptions == 0
    # the pool: every row's prompt and budget in whole blocks, plus the scratch block
    assert result.profile.num_kv_blocks == 1 + 1 + 1 + 1 + 3


@pytest.mark.slow  # 12 rows of up to 60 + 70 tokens on two routes
def test_the_pool_follows_the_rows_live_at_once_not_every_rows_budget():
    """Every row at once, no EOS, budgets that end at different steps: the pool is the replay's peak
    of blocks held at once (``simulate_refill``, bursts to the nearest budget as the engine runs them)
    plus one block per slot, well under every row's prompt and budget; the engine then peaks at
    exactly the replay's blocks and never preempts, and its tokens are the oracle's."""
    from rollout_lab.planner.occupancy import blocks_for, simulate_refill

    model = get_tiny("qwen2")
    rng = random.Random(3)
    lengths = [rng.randint(20, 60) for _ in range(12)]
    budgets = [rng.randint(4, 70) for _ in range(12)]
    prompts = make_prompts(lengths, seed=9)
    result = Rollout(model, RolloutConfig(mode="paged", kv_block_size=16, ignore_eos=True, profile=True)) \
        .generate(prompts, max_new_tokens=budgets)
    prof = result.profile
    replay = simulate_refill(lengths, budgets, budgets, num_slots=12, layout="paged", block_size=16,
                             read_interval=max(budgets))
    every = sum(blocks_for(n + b, 16) for n, b in zip(lengths, budgets))
    assert prof.num_slots == 12 and prof.num_preemptions == 0
    assert prof.num_kv_blocks - 1 == replay.peak_blocks + 12 < every
    assert prof.peak_kv_blocks == replay.peak_blocks
    assert result.sequences == [s[:b] for s, b in zip(run(model, prompts, max(budgets), mode="bucketed").sequences,
                                                        budgets)]


def test_block_allocator_bookkeeping():
    alloc = BlockAllocator(num_blocks=10, num_slots=3, block_size=4, max_blocks_per_row=4)
    assert alloc.num_free == 9 and alloc.missing(0, 5) == 2
    assert [b for _, b in alloc.grow(0, 5)] == [1, 2]
    assert alloc.grow(0, 8) == [] and alloc.missing(0, 9) == 1
    alloc.grow(1, 1)
    assert alloc.num_used == 3 and alloc.peak_used == 3
    with pytest.raises(RuntimeError, match="needs 10 blocks, 6 are free"):
        alloc.grow(1, 41)
    with pytest.raises(RuntimeError, match="more than the table's 4"):
        alloc.grow(0, 17)
    alloc.release(0)
    assert alloc.num_free == 8 and SCRATCH_BLOCK not in alloc.free and alloc.peak_used == 3
    alloc.move([1], [0])
    assert alloc.blocks[0] == [3] and alloc.blocks[1] == []


def test_admit_places_each_row_at_its_positions():
    cache = PagedKVCache(num_layers=1, num_slots=2, num_kv_heads=1, head_dim=2, block_size=2, num_blocks=8,
                         max_blocks_per_row=4, dtype=torch.float32, device="cpu")
    cache.grow(1, 3)
    cache.grow(0, 1)
    keys = torch.arange(2 * 3 * 2, dtype=torch.float32).reshape(2, 1, 3, 2)  # [rows, kv_heads, width, head_dim]
    cache.admit([1, 0], [(keys, -keys)], [3, 1], source_rows=[0, 1])  # slot 1 <- row 0 (3 tokens), slot 0 <- row 1
    pool = cache.keys[0]
    table = cache.block_tables
    for slot, row, n in ((1, 0, 3), (0, 1, 1)):
        for p in range(n):
            block = int(table[slot, p // 2])
            assert torch.equal(pool[block, p % 2, 0], keys[row, 0, 3 - n + p])
    cache.prepare_step(2, torch.tensor([1, 0]))
    assert cache.slot_mapping.tolist() == [int(table[0, 0]) * 2 + 1, int(table[1, 0]) * 2]


@pytest.mark.parametrize("config, message", [
    (dict(mode="paged", kv_block_size=24), "kv_block_size must be one of"),
    (dict(mode="paged", gpu_memory_fraction=0.0), "gpu_memory_fraction"),
    (dict(mode="paged", kv_cache_tokens=0), "kv_cache_tokens"),
    (dict(mode="paged", refill_rows=-1), "refill_rows"),
    (dict(mode="paged", admit_tokens_per_step=0), r"admit_tokens_per_step must be an int >= 1, or None, got 0"),
    (dict(mode="bucketed", admit_tokens_per_step=64),
     r"admit_tokens_per_step bounds the paged route's admissions; mode='bucketed' would ignore it"),
    (dict(mode="paged", cache_capacity=64), "mode='paged' keeps each row"),
    (dict(eos_check_interval=0), r"eos_check_interval must be 'auto' or an int in 1..64, got 0"),
    (dict(eos_check_interval="often"), "eos_check_interval must be 'auto' or an int"),
])
def test_bad_settings_fail_in_the_config(config, message):
    with pytest.raises(ValueError, match=message):
        RolloutConfig(**config)


def test_a_pool_too_small_for_one_row_fails_before_work():
    model = get_tiny("opt")
    rollout = Rollout(model, RolloutConfig(mode="paged", kv_block_size=16, kv_cache_tokens=32))
    with pytest.raises(ValueError, match=r"row 1 needs \(30 prompt \+ 8 new tokens"):
        rollout.generate(make_prompts([4, 30]), max_new_tokens=8)
    assert rollout.stepper_info["kind"] is None  # nothing was built


@pytest.mark.slow  # two calls of 16 rows x 40 tokens through 4 slots
def test_auto_replays_the_pools_worst_case_once_per_call(monkeypatch):
    """Auto prices the paged pool and then lays it out: one worst-case replay a call, not two (the
    layout is kept for the call), and a new one for the next call."""
    import rollout_lab.engine.kv.sizing as engine_rollout
    from rollout_lab.planner.cost import CostCoefficients

    calls = []
    real = engine_rollout.simulate_refill
    monkeypatch.setattr(engine_rollout, "simulate_refill", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = get_tiny("qwen2")
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 300) for _ in range(6)] for _ in range(16)]
    rollout = Rollout(model, RolloutConfig(continuous_batch_size=4, response_length_prior=(2, 2, 2, 40),
                                           costs=CostCoefficients(prefill_fixed_cost_ms=0.05)))
    first = rollout.generate(prompts, max_new_tokens=40)
    assert first.route == "paged" and len(calls) == 1
    second = rollout.generate(prompts, max_new_tokens=40)
    assert second.route == "paged" and second.sequences == first.sequences and len(calls) == 2


@pytest.mark.slow  # four calls, each against the bucketed route
def test_a_kept_pool_too_small_grows_by_a_quarter_within_what_the_call_could_use():
    """A call whose rows need more blocks than the kept pool replaces it with one PAGED_POOL_GROWTH
    times larger (so the next calls' wandering peaks rarely rebuild and recapture it), never past the
    uncut pool (every row's prompt and budget); smaller calls then keep it. Tokens stay the oracle's."""
    from rollout_lab.engine.runner.runner import PAGED_POOL_GROWTH

    model = get_tiny("qwen2")
    rollout = Rollout(model, RolloutConfig(mode="paged", continuous_batch_size=4, kv_block_size=16, ignore_eos=True,
                                           profile=True))
    pools, uncut = [], []
    for length in (20, 30, 36, 20):
        prompts = make_prompts([length] * 8, seed=length)
        result = rollout.generate(prompts, max_new_tokens=20)
        assert result.profile.num_preemptions == 0
        assert result.sequences == run(model, prompts, 20, mode="bucketed").sequences
        pools.append(result.profile.num_kv_blocks)
        uncut.append(rollout.paged_layout([length] * 8, [20] * 8, 20))
    assert [u.num_blocks for u in uncut] == [17, 21, 21, 17]  # what each call alone would allocate
    assert pools == [17, math.ceil(17 * PAGED_POOL_GROWTH), 22, 22]  # grown once, then kept
    assert all(p <= u.max_blocks for p, u in zip(pools, uncut))
