"""planner.occupancy: the refill schedule of both layouts against a brute-force replay, and Auto
taking the paged route where the aligned cache would wait (and only there)."""
from __future__ import annotations

import heapq
import random
import time

import pytest
from conftest import get_tiny, one_fast

from rollout_lab import Rollout, RolloutConfig
from rollout_lab.planner.cost import CostCoefficients, ModelGeometry
from rollout_lab.planner.occupancy import RefillSchedule, blocks_for, response_quantiles, simulate_refill
from rollout_lab.planner.routes import choose_route, choose_shared_route


def brute_force(prompts, lengths, budgets, slots, layout, capacity, refill_rows=1, read_interval=1):
    """One step at a time, every row's state spelled out (the engine's loop, without tensors): a turn
    admits, then runs a burst of at most ``read_interval`` steps and never past a live budget."""
    queue, live, steps, row_steps = list(range(len(prompts))), [], 0, 0  # live: [row, tokens made]
    while queue or live:
        if layout == "paged":  # one admission a turn (again while nothing is live), of refill_rows at least
            while queue:
                take = min(slots - len(live), len(queue))
                if take == 0 or (live and take < min(refill_rows, len(queue), slots)):
                    break
                live += [[r, 1] for r in queue[:take] if lengths[r] > 1]
                del queue[:take]
                if live:
                    break
        else:
            while queue and len(live) < slots:
                r = queue[0]
                span = max([prompts[x] + made - 1 for x, made in live] + [prompts[r]])
                remaining = max([budgets[x] - made for x, made in live] + [budgets[r] - 1])
                if span + remaining > capacity:
                    break
                queue.pop(0)
                if lengths[r] > 1:
                    live.append([r, 1])
        if not live:
            continue
        for _ in range(min(min(budgets[x] - made for x, made in live), read_interval)):
            steps += 1
            for row in live:
                if row[1] < lengths[row[0]]:  # a row that ended keeps its slot to the burst's end
                    row[1] += 1
                    row_steps += 1
        live = [row for row in live if row[1] < lengths[row[0]]]
    return steps, row_steps


@pytest.mark.parametrize("seed", range(12))
def test_simulation_equals_a_step_by_step_replay(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 40)
    prompts = [rng.randint(1, 30) for _ in range(n)]
    budgets = [rng.randint(1, 50) for _ in range(n)]
    lengths = [rng.randint(1, b) for b in budgets]
    slots = rng.randint(1, 8)
    rules = dict(refill_rows=rng.randint(1, 4), read_interval=rng.randint(1, 5)) if seed % 2 else {}
    for layout in ("aligned", "paged"):
        capacity = max(prompts) + max(budgets) + rng.randint(0, 20)
        got = simulate_refill(prompts, lengths, budgets, num_slots=slots, layout=layout, capacity=capacity, **rules)
        assert (got.steps, got.row_steps) == brute_force(prompts, lengths, budgets, slots, layout, capacity, **rules)


def test_a_long_row_blocks_the_aligned_cache_only():
    prompts, budgets = [10] * 20, [100] * 20
    lengths = [100] + [5] * 19  # EOS ends all but one early; the cache must still hold every budget
    aligned = simulate_refill(prompts, lengths, budgets, num_slots=4, layout="aligned")
    paged = simulate_refill(prompts, lengths, budgets, num_slots=4, layout="paged")
    assert paged.steps == 99  # the long row's own steps: the 19 others ride beside it
    assert aligned.steps == 99 + 4 * 4  # the 16 rows after the first wave wait for the long one, then run in 4 waves
    assert aligned.queued_occupancy < 0.4 and paged.queued_occupancy == 1.0  # until the queue drained
    assert aligned.occupancy < paged.occupancy
    with pytest.raises(ValueError, match="layout must be one of"):
        simulate_refill(prompts, lengths, budgets, num_slots=4, layout="dense")
    with pytest.raises(ValueError, match=r"in \[1, its budget\]"):
        simulate_refill([3], [9], [8], num_slots=1, layout="paged")


def test_response_quantiles_follow_the_prior():
    rows = response_quantiles({5: 0.5, 200: 0.5}, [100] * 10)
    assert sorted(rows) == [5] * 5 + [100] * 5  # clipped at the budget
    assert rows != sorted(rows)  # long and short rows interleave in the queue


def test_auto_takes_paged_when_refill_would_wait():
    geometry, costs = ModelGeometry.qwen25_3b(), CostCoefficients()
    common = dict(max_new_tokens=100, geometry=geometry, costs=costs, paged_allowed=True)
    prior = {5: 0.9, 100: 0.1}  # most rows end early, a tenth run the whole budget
    plan = choose_route([10] * 40, continuous_batch_size=4, response_lengths=prior, **common)
    assert plan.route == "paged" and plan.paged_cost_ms < plan.cb_cost_ms
    # without refill, without a long tail, or when not allowed: the aligned routes as before
    assert choose_route([10] * 4, continuous_batch_size=4, response_lengths=prior, **common).route != "paged"
    assert choose_route([10] * 40, continuous_batch_size=4, **common).route == "bucketed"
    no = dict(common, paged_allowed=False)
    assert choose_route([10] * 40, continuous_batch_size=4, response_lengths=prior, **no).route == "bucketed"


@pytest.mark.slow  # 16 rows x 40 tokens through 4 slots, twice
def test_rollout_auto_learns_the_tail_and_goes_paged():
    """With prior_ewma the first call's response lengths price the next call's route."""
    model = get_tiny("qwen2")
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 300) for _ in range(6)] for _ in range(16)]
    rollout = Rollout(model, RolloutConfig(continuous_batch_size=4, prior_ewma=1.0, response_length_prior=(2, 2, 2, 40),
                                           costs=CostCoefficients(prefill_fixed_cost_ms=0.05)))
    result = rollout.generate(prompts, max_new_tokens=40)
    assert result.route == "paged"
    assert result.sequences == Rollout(model, RolloutConfig(mode="bucketed")).generate(prompts, max_new_tokens=40).sequences


@pytest.mark.parametrize("seed", one_fast(range(4), 0))
def test_pool_replay_equals_the_paged_engine(seed):
    """With a pool too small for every row, the replay's decode steps and preemptions are the
    engine's (tiny fp32 model, budgets without EOS, one row admitted at a time allowed)."""
    rng = random.Random(seed)
    n, slots = rng.randint(6, 14), rng.randint(3, 6)
    prompts = [rng.randint(1, 40) for _ in range(n)]
    budgets = [rng.randint(2, 40) for _ in range(n)]
    size = 16
    need = max(-(-(p + b) // size) for p, b in zip(prompts, budgets))
    pool = need + rng.randint(0, 2)  # tight: the rows together never fit
    # without EOS the engine reads the tokens at the nearest budget: bursts up to the longest budget
    sim = simulate_refill(prompts, budgets, budgets, num_slots=slots, layout="paged", pool_blocks=pool,
                          block_size=size, read_interval=max(budgets))
    model = get_tiny("qwen2")
    ids = [[rng.randrange(3, 200) for _ in range(p)] for p in prompts]
    result = Rollout(model, RolloutConfig(
        mode="paged", kv_block_size=size, continuous_batch_size=slots, kv_cache_tokens=pool * size, refill_rows=1,
        ignore_eos=True, profile=True)).generate(ids, max_new_tokens=budgets)
    prof = result.profile
    assert prof.num_kv_blocks - 1 == pool  # the scratch block is not the rows'
    assert (prof.num_decode_forwards, prof.num_preemptions) == (sim.steps, sim.preemptions)
    assert prof.decode_row_steps == sim.row_steps
    assert len(sim.recompute_widths) == sim.preemptions


def test_pool_replay_preempts_and_refuses_a_pool_below_one_row():
    prompts, budgets = [10] * 8, [60] * 8
    roomy = simulate_refill(prompts, budgets, budgets, num_slots=8, layout="paged")
    tight = simulate_refill(prompts, budgets, budgets, num_slots=8, layout="paged", pool_blocks=12, block_size=16)
    assert roomy.preemptions == 0 and tight.preemptions > 0
    assert tight.steps > roomy.steps and tight.row_steps == roomy.row_steps  # the same tokens, fewer at once
    assert all(w >= 10 for w in tight.recompute_widths)  # a prompt and the tokens made before it left
    with pytest.raises(ValueError, match="cannot hold row 0 alone"):
        simulate_refill(prompts, budgets, budgets, num_slots=8, layout="paged", pool_blocks=4, block_size=16)
    with pytest.raises(ValueError, match="layout 'aligned' has no pool"):
        simulate_refill(prompts, budgets, budgets, num_slots=8, layout="aligned", pool_blocks=12)
    with pytest.raises(ValueError, match="block_size must be an int >= 1, got 0"):
        simulate_refill(prompts, budgets, budgets, num_slots=8, layout="paged", pool_blocks=12, block_size=0)


def test_auto_prices_preemption_and_leaves_out_a_pool_below_one_row():
    geometry, costs = ModelGeometry.qwen25_3b(), CostCoefficients()
    common = dict(max_new_tokens=100, geometry=geometry, costs=costs, paged_allowed=True, continuous_batch_size=4,
                  response_lengths={5: 0.9, 100: 0.1}, kv_block_size=16)
    roomy = choose_route([10] * 40, **common)
    held = choose_route([10] * 40, paged_pool_blocks=4 * 7, **common)  # four rows at their worst case
    tight = choose_route([10] * 40, paged_pool_blocks=9, **common)  # one long row, or a few short ones
    assert roomy.route == held.route == "paged" and held.paged_cost_ms == roomy.paged_cost_ms
    assert tight.paged_cost_ms > roomy.paged_cost_ms  # fewer rows at once, and their recompute
    none = choose_route([10] * 40, paged_pool_blocks=6, **common)  # 10 + 100 tokens need 7 blocks
    assert none.paged_cost_ms is None and none.route != "paged"


def test_auto_prices_a_tight_pool_with_shared_prompt_blocks_as_the_engine_holds_them():
    geometry, costs = ModelGeometry.qwen25_3b(), CostCoefficients()
    common = dict(max_new_tokens=16, geometry=geometry, costs=costs, paged_allowed=True, continuous_batch_size=8,
                  kv_block_size=16, paged_pool_blocks=24, rows_per_prompt=[8] * 4, nocb_allowed=False)
    copies = choose_route([64] * 4, **common)  # 8 samples of 64 tokens: 5 blocks each as copies, 1 + 4 once shared
    shared = choose_route([64] * 4, share_prompt_blocks=True, **common)
    assert shared.paged_cost_ms < copies.paged_cost_ms  # more rows at once, no preemption's recompute
    assert choose_route([64] * 4, **{**common, "rows_per_prompt": None}).paged_cost_ms \
        == choose_route([64] * 4, share_prompt_blocks=True, **{**common, "rows_per_prompt": None}).paged_cost_ms


@pytest.mark.slow  # 16 rows x 40 tokens through 4 slots, twice
def test_rollout_auto_leaves_paged_out_when_its_pool_cannot_hold_a_row():
    model = get_tiny("qwen2")
    rng = random.Random(1)
    prompts = [[rng.randrange(1, 300) for _ in range(6)] for _ in range(16)]
    config = dict(continuous_batch_size=4, prior_ewma=1.0, response_length_prior=(2, 2, 2, 40), kv_block_size=16,
                  costs=CostCoefficients(prefill_fixed_cost_ms=0.05))
    small = Rollout(model, RolloutConfig(kv_cache_tokens=32, **config))  # 6 + 40 tokens need 3 blocks
    assert small.generate(prompts, max_new_tokens=40).route != "paged"
    assert Rollout(model, RolloutConfig(kv_cache_tokens=4096, **config)).generate(
        prompts, max_new_tokens=40).route == "paged"


def test_shared_prompts_refill_counts_rows_not_prompts():
    """8 prompts x 8 samples on 16 slots refill: the decode is priced over the 64 rows (paged a
    candidate), as the same rows given one by one, while the prefill plan stays over the 8 prompts."""
    geometry, costs = ModelGeometry.qwen25_3b(), CostCoefficients()
    common = dict(max_new_tokens=100, geometry=geometry, costs=costs, paged_allowed=True, continuous_batch_size=16,
                  response_lengths={5: 0.9, 100: 0.1})
    shared = choose_shared_route([10] * 8, [8] * 8, **common)
    rows = choose_route([10] * 64, **common)
    assert shared.route == rows.route == "paged"
    # the same decode estimates: the gap between the caches is the rows' whatever the prefill plan
    assert shared.cb_cost_ms - shared.paged_cost_ms == pytest.approx(rows.cb_cost_ms - rows.paged_cost_ms)
    assert shared.cb_cost_ms - shared.paged_cost_ms > 0
    with pytest.raises(ValueError, match=r"one count per prompt \(8\), got 2"):
        choose_route([10] * 8, rows_per_prompt=[8, 8], **common)


@pytest.mark.slow  # 16 rows x 40 tokens through 4 slots, on two routes
def test_rollout_auto_goes_paged_for_samples_that_refill():
    """4 prompts x 4 samples on 4 slots: the 16 rows refill, so Auto prices them (it once counted
    the 4 prompts, which fit the slots, and never offered paged); the tokens are the aligned route's."""
    model = get_tiny("qwen2")
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 300) for _ in range(6)] for _ in range(4)]
    auto = Rollout(model, RolloutConfig(continuous_batch_size=4, prior_ewma=1.0, response_length_prior=(2, 2, 2, 40),
                                        costs=CostCoefficients(prefill_fixed_cost_ms=0.05)))
    result = auto.generate(prompts, max_new_tokens=40, num_samples=4)
    aligned = Rollout(model, RolloutConfig(mode="bucketed", continuous_batch_size=4))
    assert result.route == "paged"
    assert result.sequences == aligned.generate(prompts, max_new_tokens=40, num_samples=4).sequences


@pytest.mark.parametrize("mode, layout, pool", one_fast([("paged", "paged", None), ("paged", "paged", 4),
                                                         ("bucketed", "aligned", None)], ("paged", "paged", 4)))
@pytest.mark.parametrize("interval, refill", one_fast([(1, 1), (4, 3)], (4, 3)))
def test_the_replay_counts_the_engines_steps_and_row_steps(mode, layout, pool, interval, refill):
    """The engine's own decode steps, live row-steps and preemptions (fp32, CPU, rows ending at EOS,
    sampled), replayed by ``simulate_refill`` from the prompts, the response lengths it made and the
    budget; ``pool``: a paged pool of that many 16-token blocks, too small for the rows at once."""
    from rollout_lab.measure.workloads import eos_long_tail

    model = get_tiny("qwen2")
    vocab = model.get_input_embeddings().weight.shape[0]
    _, eos = eos_long_tail(vocab, num_prompts=1, dataset="gsm8k", hazard=0.08, special_ids=[0])
    rng = random.Random(interval)
    prompts = [[rng.randint(3, vocab - 1) for _ in range(rng.randint(2, 12))] for _ in range(14)]
    sized = {} if pool is None else dict(kv_cache_tokens=pool * 16, kv_block_size=16)
    config = RolloutConfig(mode=mode, continuous_batch_size=4, eos_token_id=eos, pad_token_id=0,
                           eos_check_interval=interval, refill_rows=refill, profile=True, **sized)
    budget = 24
    result = Rollout(model, config).generate(prompts, max_new_tokens=budget, do_sample=True, temperature=1.0, seed=5)
    lengths = [len(s) for s in result.sequences]
    assert min(lengths) < budget < max(lengths) + 1 and len(set(lengths)) > 3  # rows end at different times
    got = simulate_refill([len(p) for p in prompts], lengths, [budget] * len(prompts), num_slots=4, layout=layout,
                          refill_rows=refill if layout == "paged" else 1, read_interval=interval,
                          block_size=config.kv_block_size, **({} if pool is None else dict(pool_blocks=pool)))
    prof = result.profile
    assert (got.steps, got.row_steps) == (prof.num_decode_forwards, prof.decode_row_steps)
    assert got.preemptions == prof.num_preemptions
    if layout == "paged":
        assert got.peak_blocks == prof.peak_kv_blocks  # blocks of 64 (16 with the pool) held at once
    if pool is not None:  # the watermark held rows back: fewer live than the slots at times
        assert prof.num_kv_blocks - 1 == pool and prof.peak_kv_blocks <= pool


def turn_by_turn(prompt_lengths, response_lengths, budgets, *, num_slots, layout, capacity=None, pool_blocks=None,
                 block_size=16, refill_rows=1, read_interval=1):
    """``simulate_refill`` as it was before it jumped over quiet turns: one turn (an admission, a burst
    of at most ``read_interval`` steps, the rows' ends) at a time, every turn replayed."""
    if pool_blocks is not None:
        return _turn_by_turn_pool(prompt_lengths, response_lengths, budgets, num_slots, pool_blocks, block_size,
                                  refill_rows, read_interval)
    n = len(prompt_lengths)
    if capacity is None:
        capacity = max(prompt_lengths) + max(budgets)
    # a row that enters before step t's token has made 1 token (its prefill's) and makes one per step:
    # it makes its last token at step t + length - 1 and reaches its budget at t + budget - 1. The
    # aligned check only needs two maxima over the live rows: span = L + steps since entry =
    # (L - t) + step, remaining budget = (B - 1 + t) - step.
    live: dict[int, int] = {}  # row -> the step count when it entered
    ends: list[tuple[int, int]] = []  # heap of (last step, row)
    budget_ends: list[tuple[int, int]] = []  # heap of (the step its budget runs out, row); stale rows skipped
    queue = step = row_steps = queued_steps = queued_row_steps = peak = 0
    span_key = remaining_key = None  # max over live rows of L - t and B - 1 + t (None: recompute)

    def enter(row: int) -> None:
        if response_lengths[row] > 1:  # a row done at its prefill never takes a step
            live[row] = step
            heapq.heappush(ends, (step + response_lengths[row] - 1, row))
            heapq.heappush(budget_ends, (step + budgets[row] - 1, row))

    while queue < n or live:
        if layout == "paged":  # one admission a turn, the next turn at once while nothing is live
            while queue < n:
                take = min(num_slots - len(live), n - queue)
                if take == 0 or (live and take < min(refill_rows, n - queue, num_slots)):
                    break
                for row in range(queue, queue + take):
                    enter(row)
                queue += take
                if live:
                    break
        else:
            while queue < n and len(live) < num_slots:
                if span_key is None:
                    span_key = max((prompt_lengths[r] - t for r, t in live.items()), default=None)
                    remaining_key = max((budgets[r] - 1 + t for r, t in live.items()), default=None)
                span = max(prompt_lengths[queue], step + span_key if live else 0)
                remaining = max(budgets[queue] - 1, remaining_key - step if live else 0)
                if span > capacity - remaining:
                    break
                enter(queue)
                span_key = None
                queue += 1
        if not live:
            continue
        while budget_ends[0][1] not in live:
            heapq.heappop(budget_ends)  # a row that retired
        burst = min(budget_ends[0][0] - step, read_interval)  # a burst: every live row makes a token a step
        if layout == "paged":  # each live row's blocks for its tokens so far and the burst's, reserved before it
            peak = max(peak, sum(blocks_for(prompt_lengths[r] + step - t + burst, block_size) for r, t in live.items()))
        step += burst
        kept = burst * len(live)  # row-steps that made a row's token (not those after its end)
        while ends and ends[0][0] <= step:
            last, row = heapq.heappop(ends)
            kept -= step - last
            del live[row]
            span_key = None
        row_steps += kept
        if queue < n:
            queued_steps += burst
            queued_row_steps += kept
    return RefillSchedule(step, row_steps, num_slots, queued_steps, queued_row_steps, peak_blocks=peak)


def _turn_by_turn_pool(prompts, lengths, budgets, num_slots, pool, size, refill_rows, read_interval):
    def blocks(tokens):
        return blocks_for(tokens, size)

    n = len(prompts)
    fresh = 0  # the next row never admitted
    waiting: list[int] = []  # preempted rows, the next to return first
    made = [0] * n  # tokens each row has made
    held: dict[int, int] = {}  # live row -> its blocks, in admission order (dicts keep it)
    free = pool
    step = row_steps = queued_steps = queued_row_steps = peak = 0
    recompute: list[int] = []

    def queue_head(count: int) -> list[int]:
        """The first ``count`` rows of the queue: the preempted ones (the newest first), then the fresh."""
        head = waiting[::-1][:count]
        return head + list(range(fresh, min(n, fresh + count - len(head))))

    while fresh < n or waiting or held:
        while fresh < n or waiting:  # one admission a turn, the next turn at once while nothing is live
            queued = n - fresh + len(waiting)
            chosen, budget = [], free
            for row in queue_head(num_slots - len(held)):
                need = blocks(prompts[row] + max(1, made[row]))  # its prompt (and tokens) + the next step's
                # the watermark: one free block per live row stays after it (never blocking an empty pool)
                if need > budget - (len(held) + len(chosen) + 1):
                    break
                budget -= need
                chosen.append((row, need))
            if not chosen and not held:
                row = queue_head(1)[0]
                need = blocks(prompts[row] + max(1, made[row]))
                if need <= free:
                    chosen = [(row, need)]
            if not chosen or (held and len(chosen) < min(refill_rows, queued, num_slots)):
                break
            for row, need in chosen:
                if waiting and row == waiting[-1]:
                    waiting.pop()
                    recompute.append(prompts[row] + made[row] - 1)  # its prompt and all but its last token
                else:
                    fresh += 1
                    made[row] = 1  # the prefill's token
                    if lengths[row] == 1:
                        continue  # done at its prefill: never takes a step (nor keeps its blocks)
                held[row] = need
                free -= need
            if held:
                break
        if not held:
            continue
        burst = min(min(budgets[row] - made[row] for row in held), read_interval)
        while True:  # growth: every live row's blocks for the burst, else one step, else preempt the newest
            needs = {row: blocks(prompts[row] + made[row] - 1 + burst) - b for row, b in held.items()}
            if sum(needs.values()) <= free:
                break
            if burst > 1:
                burst = 1
                continue
            newest = next(reversed(held))
            free += held.pop(newest)
            waiting.append(newest)
        for row, need in needs.items():
            held[row] += need
            free -= need
        peak = max(peak, pool - free)
        step += burst
        kept = 0
        for row in list(held):
            run = min(burst, lengths[row] - made[row])  # a row that ends inside the burst keeps its slot to its end
            made[row] += run
            kept += run
        row_steps += kept
        if fresh < n or waiting:
            queued_steps += burst
            queued_row_steps += kept
        for row in list(held):
            if made[row] == lengths[row]:
                free += held.pop(row)
    # every preempted row came back, once per preemption
    return RefillSchedule(step, row_steps, num_slots, queued_steps, queued_row_steps,
                          preemptions=len(recompute), recompute_widths=tuple(recompute), peak_blocks=peak)


def random_call(rng: random.Random, *, long: bool) -> tuple[list[int], list[int], list[int], dict]:
    """Prompts, response lengths, budgets and the admission rules of a random call; ``long``: budgets
    of hundreds of steps, where the replay jumps."""
    n = rng.randint(1, 30)
    prompts = [rng.randint(1, 60) for _ in range(n)]
    budgets = [rng.randint(1, 600 if long else 40) for _ in range(n)]
    lengths = [rng.choice([b, rng.randint(1, b)]) for b in budgets]
    rules = dict(num_slots=rng.randint(1, 9), refill_rows=rng.randint(1, 4), read_interval=rng.choice([1, 2, 7, 64]))
    return prompts, lengths, budgets, rules


@pytest.mark.parametrize("long", [False, pytest.param(True, marks=pytest.mark.slow)])  # slow: the turns, replayed
def test_the_jumps_give_the_turn_by_turn_schedule(long):
    rng = random.Random(long)
    for _ in range(150):
        prompts, lengths, budgets, rules = random_call(rng, long=long)
        for layout in ("aligned", "paged"):
            tight = max(p + b - 1 for p, b in zip(prompts, budgets))  # a long prompt can wait for long budgets
            capacity = rng.choice([tight, tight, max(prompts) + max(budgets), tight + rng.randint(1, 300)])
            assert simulate_refill(prompts, lengths, budgets, layout=layout, capacity=capacity, **rules) == \
                turn_by_turn(prompts, lengths, budgets, layout=layout, capacity=capacity, **rules)
        need = max(blocks_for(p + r, 16) for p, r in zip(prompts, lengths))
        pool = dict(pool_blocks=need + rng.randint(0, 3 * len(prompts)), block_size=16)  # tight to roomy
        assert simulate_refill(prompts, lengths, budgets, layout="paged", **pool, **rules) == \
            turn_by_turn(prompts, lengths, budgets, layout="paged", **pool, **rules)


def test_a_huge_budget_costs_the_rows_not_the_steps():
    start = time.perf_counter()
    budgets = [10**9, 10**9, 5 * 10**8]
    for layout, pool, interval in (("aligned", None, 1), ("paged", None, 1), ("paged", 3 * 10**8, 16)):
        got = simulate_refill([16, 16, 40], budgets, budgets, num_slots=2, layout=layout, pool_blocks=pool,
                              read_interval=interval)
        assert got.row_steps == sum(b - 1 for b in budgets)
    assert time.perf_counter() - start < 0.5
