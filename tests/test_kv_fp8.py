"""The FP8 paged KV cache (engine.kernels.kv_fp8, RolloutConfig(kv_cache_dtype="fp8")): quantization
bounds and round trips, the pool layout, the decode write, the paged attention over FP8 pools against
its dequantized reference, the cache's host-side reads and writes, whole rollouts (the oracle's route
machinery with a tight pool, samples and the prefix cache) and their logprob mismatch, and the settings
it refuses. The Triton kernels run under the interpreter in a subprocess and on CUDA when present."""
from __future__ import annotations

import textwrap

import pytest
import torch
from conftest import get_tiny, run_interpreted

from rollout_lab import Rollout, RolloutConfig
from rollout_lab.engine.kernels import kv_fp8
from rollout_lab.engine.kernels.paged import BLOCK_SIZES, paged_attention, paged_attention_reference
from rollout_lab.engine.kernels.shared_prefix import shared_prefix_attention
from rollout_lab.engine.kv.paged import PagedKVCache
from rollout_lab.engine.runner.compiling import compile_forward, tracing
from rollout_lab.engine.runner.prefill import cache_kwarg_name, prefill_bucket
from rollout_lab.engine.runner.steppers import EagerStepper, StepperKey
from rollout_lab.engine.trainer import sequence_logprobs
from rollout_lab.measure.models import TINY_VOCAB_SIZE
from rollout_lab.planner.cost import ModelGeometry
from test_partial_rollouts import BUDGET, PAGED, SAMPLED, TIGHT, continued, eos_of, make_prompts

try:
    import triton  # noqa: F401
    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False
on_cuda = pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON, reason="needs a CUDA GPU and Triton")


def test_quantize_bounds_each_value_and_round_trips():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 64, generator=gen) * torch.rand(50, 3, 1, generator=gen) * 100
    x[4, 1] = 0.0
    q, s = kv_fp8.quantize(x)
    assert q.dtype == kv_fp8.FP8_DTYPE and s.dtype == torch.float32 and s.shape == (50, 3)
    back = kv_fp8.dequantize(q, s, torch.float32)
    # half an e4m3 ulp (2**-4 of the value), or its subnormal step (2**-9 of the scale) for small values
    assert bool(((back - x).abs() <= x.abs() / 16 + s[..., None] * 2.0 ** -9).all())
    assert torch.equal(back.abs().amax(-1)[s > kv_fp8.TINY_SCALE], (s * kv_fp8.FP8_MAX)[s > kv_fp8.TINY_SCALE])
    assert bool((back[4, 1] == 0).all()) and float(s[4, 1]) == kv_fp8.TINY_SCALE
    q2, s2 = kv_fp8.quantize(back)  # a dequantized token stores back to its own bits
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s2, s)
    assert float((back - x).abs().max()) > 0  # lossy


@pytest.mark.parametrize("head_dim", [16, 32, 64, 128, 256])
def test_the_block_size_reads_back_from_the_pool(head_dim):
    for block_size in BLOCK_SIZES:
        pool = kv_fp8.allocate(3, block_size, 2, head_dim, "cpu")
        assert kv_fp8.pool_block_size(pool.shape[1], head_dim) == block_size
        values, scales = kv_fp8.split(pool)
        assert values.shape == (3, block_size, 2, head_dim) and scales.shape == (3, block_size, 2)
        values[1, 2, 1] = torch.ones(head_dim).to(kv_fp8.FP8_DTYPE)
        scales[2, block_size - 1, 1] = 2.5
        assert int(pool.count_nonzero()) == head_dim + 2  # the views write the pool: 2.5 is two non-zero bytes
        geometry = ModelGeometry(3, 4, 2, head_dim, 2)  # 3 layers of 2 KV heads; the pools' bytes, keys and values
        assert kv_fp8.kv_bytes_per_token(geometry, block_size) == 2 * 3 * pool[0].numel() / block_size


def test_a_pool_that_is_no_fp8_layout_is_named():
    with pytest.raises(ValueError, match="contiguous uint8"):
        kv_fp8.split(torch.zeros(2, 17, 2, 64))
    with pytest.raises(ValueError, match="18 rows per block is no FP8 pool's block"):
        kv_fp8.split(torch.zeros(2, 18, 2, 64, dtype=torch.uint8))


def write_case(device: str, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(1)
    block_size, kv_heads, head_dim = 16, 2, 64
    pools = [kv_fp8.allocate(6, block_size, kv_heads, head_dim, device) for _ in range(2)]
    keys, values = ((torch.randn(5, kv_heads, head_dim, generator=gen) * 7).to(device, dtype) for _ in range(2))
    slots = torch.tensor([17, 63, 2, 80, 71], device=device)
    return pools, keys, values, slots


def test_the_decode_write_quantizes_each_row_into_its_slot():
    (key_pool, value_pool), keys, values, slots = write_case("cpu")
    kv_fp8.paged_write_fp8(key_pool, value_pool, keys, values, slots)
    for pool, new in ((key_pool, keys), (value_pool, values)):
        stored, scales = kv_fp8.split(pool)
        q, s = kv_fp8.quantize(new)
        block, row = slots // 16, slots % 16
        assert torch.equal(stored[block, row].view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(scales[block, row], s)
        assert int(scales.count_nonzero()) == 2 * len(slots)  # nothing else written


def attention_case(device: str, block_size: int, kv_heads: int, group: int, head_dim: int):
    gen = torch.Generator().manual_seed(2)
    blocks, rows = 13, 3
    pools = [kv_fp8.allocate(blocks, block_size, kv_heads, head_dim, device) for _ in range(2)]
    tokens = blocks * block_size
    kv = [torch.randn(tokens, kv_heads, head_dim, generator=gen).to(device) for _ in range(2)]
    kv_fp8.paged_write_fp8(*pools, *kv, torch.arange(tokens, device=device))
    tables = (torch.randperm(blocks - 1, generator=gen)[: (blocks - 1) // rows * rows].view(rows, -1) + 1).int()
    positions = torch.tensor([5, 2 * block_size + 3, tables.shape[1] * block_size - 1])
    query = torch.randn(rows, kv_heads * group, 1, head_dim, generator=gen)
    dense = [kv_fp8.dequantize(*kv_fp8.split(pool), torch.float32) for pool in pools]
    exact = [t.view(blocks, block_size, kv_heads, head_dim) for t in kv]
    return [t.to(device) for t in (query, tables, positions)], pools, dense, exact


def check_fp8_attention(device: str) -> None:
    """The paged attention over FP8 pools: its dequantized pools' reference, and near the unrounded KV's."""
    for block_size, kv_heads, group, head_dim in ((16, 2, 7, 64), (32, 1, 4, 32), (64, 2, 1, 128)):
        (query, tables, positions), pools, dense, exact = attention_case(device, block_size, kv_heads, group, head_dim)
        scale = head_dim ** -0.5
        got = paged_attention(query, *pools, tables, positions, scale)
        want = paged_attention_reference(query, *dense, tables, positions, scale)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        rounded = float((got - paged_attention_reference(query, *(t.to(device) for t in exact), tables, positions,
                                                         scale)).abs().max())
        assert 0 < rounded < 0.2


def test_paged_attention_reads_fp8_pools_by_the_reference():
    check_fp8_attention("cpu")  # without Triton (or outside the interpreter): the torch reference


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON or torch.cuda.is_available(), reason="needs Triton on a machine without CUDA")
def test_the_paged_kernel_reads_fp8_pools_in_the_interpreter():
    script = textwrap.dedent("""
        from test_kv_fp8 import check_fp8_attention
        check_fp8_attention("cpu")
        print("ok")
    """)
    assert "ok" in run_interpreted(script)


def check_write_kernel_addressing() -> None:
    """The decode write's Triton kernel, called as CUDA calls it, against the torch ops, on values
    e4m3 holds exactly after their scale (each vector's amax 448 x a power of two): its blocks, rows,
    heads and scale rows are the torch ops', with no rounding (the interpreter's e4m3 rounding is
    wrong where a mantissa carries)."""
    gen = torch.Generator().manual_seed(0)
    block_size, kv_heads, head_dim = 16, 2, 64
    grid = torch.arange(256, dtype=torch.uint8).view(kv_fp8.FP8_DTYPE).float()
    grid = grid[torch.isfinite(grid)]

    def exact_rows(n: int) -> torch.Tensor:
        q = grid[torch.randint(0, len(grid), (n, kv_heads, head_dim), generator=gen)]
        q[..., 0] = kv_fp8.FP8_MAX
        return q * 2.0 ** torch.randint(-6, 6, (n, kv_heads, 1), generator=gen).float()

    keys, values = exact_rows(5), exact_rows(5)
    slots = torch.tensor([17, 63, 2, 80, 71])
    pools = [kv_fp8.allocate(6, block_size, kv_heads, head_dim, "cpu") for _ in range(2)]
    twins = [pool.clone() for pool in pools]
    kv_fp8._write_fp8_kernel[(5, kv_heads)](
        *pools, keys, values, slots, keys.stride(0), keys.stride(1), values.stride(0), values.stride(1),
        pools[0].stride(0), pools[0].stride(1), pools[0].stride(2), BLOCK_SIZE=block_size, KV_HEADS=kv_heads,
        HEAD_DIM=head_dim, num_warps=1)
    kv_fp8.paged_write_fp8(*twins, keys, values, slots)  # on the CPU: the torch ops
    assert torch.equal(pools[0], twins[0]) and torch.equal(pools[1], twins[1])


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON or torch.cuda.is_available(), reason="needs Triton on a machine without CUDA")
def test_the_write_kernel_addresses_blocks_rows_and_scales_in_the_interpreter():
    script = textwrap.dedent("""
        from test_kv_fp8 import check_write_kernel_addressing
        check_write_kernel_addressing()
        print("ok")
    """)
    assert "ok" in run_interpreted(script)


@on_cuda
def test_cuda_write_kernel_and_attention():
    for dtype in (torch.float32, torch.bfloat16):
        (key_pool, value_pool), keys, values, slots = write_case("cuda", dtype)
        twin = [key_pool.clone(), value_pool.clone()]
        kv_fp8.paged_write_fp8(key_pool, value_pool, keys, values, slots)  # the kernel
        for pool, new in zip(twin, (keys, values)):  # the torch ops, by hand
            stored, scales = kv_fp8.split(pool)
            stored[slots // 16, slots % 16], scales[slots // 16, slots % 16] = kv_fp8.quantize(new)
        assert torch.equal(key_pool, twin[0]) and torch.equal(value_pool, twin[1])
    check_fp8_attention("cuda")


def test_the_shared_prefix_read_refuses_fp8_pools():
    pool = kv_fp8.allocate(4, 16, 1, 16, "cpu")
    ints = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="does not take FP8 pools"):
        shared_prefix_attention(torch.zeros(1, 1, 1, 16), pool, pool, ints, torch.zeros(1, dtype=torch.long),
                                torch.zeros(1, dtype=torch.int32), ints, torch.zeros(1, dtype=torch.int32), 1.0)


def test_the_cache_quantizes_what_it_admits_and_reads_it_back():
    make = dict(num_layers=2, num_slots=2, num_kv_heads=2, head_dim=16, block_size=16, num_blocks=8,
                max_blocks_per_row=4, dtype=torch.float32, device="cpu")
    cache, plain = PagedKVCache(kv_dtype="fp8", **make), PagedKVCache(**make)
    assert cache.num_bytes == pytest.approx(plain.num_bytes * (16 + 4) / 16 / 4)  # a byte a value, 4 scale rows
    gen = torch.Generator().manual_seed(3)
    layer_kv = [tuple(torch.randn(1, 2, 40, 16, generator=gen) for _ in range(2)) for _ in range(2)]
    for c in (cache, plain):
        c.grow(1, 40)
        c.admit([1], layer_kv, [40])
    got, want = cache.read_positions(1, 0, 40), plain.read_positions(1, 0, 40)
    for (gk, gv), (wk, wv) in zip(got, want):
        assert torch.equal(wk, layer_kv[0][0]) or torch.equal(wk, layer_kv[1][0])
        for g, w in ((gk, wk), (gv, wv)):
            assert g.dtype == torch.float32 and 0 < float((g - w).abs().max()) <= float(w.abs().max()) / 16
    cache.grow(0, 40)
    cache.copy_positions([0], [1], [0], [40])  # a copy keeps the bits
    assert all(torch.equal(a, b) for pair_a, pair_b in zip(cache.read_positions(0, 0, 40), got)
               for a, b in zip(pair_a, pair_b))
    cache.write_positions(0, 0, got)  # and so does writing back what was read
    assert all(torch.equal(a, b) for pair_a, pair_b in zip(cache.read_positions(0, 0, 40), got)
               for a, b in zip(pair_a, pair_b))


def mismatch(result, model) -> tuple[float, float]:
    """(max, mean) |rollout logprob - the model's teacher-forced fp32 logprob| over response tokens."""
    t = result.to_tensors()
    mask = t["response_mask"]
    with torch.no_grad():
        gap = (sequence_logprobs(model, t["input_ids"], t["attention_mask"], mask) - t["logprobs"]).abs()[mask]
    return float(gap.max()), float(gap.mean())


def test_a_rollout_decodes_over_an_fp8_pool_with_a_bounded_mismatch():
    model = get_tiny("qwen2")
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, TINY_VOCAB_SIZE, (int(n),), generator=gen).tolist() for n in (3, 18, 7, 33, 12, 25)]
    call = dict(max_new_tokens=24, num_samples=2, do_sample=True, seed=5, return_logprobs=True, progress=False)
    # a pool of 8 blocks of 16 for 12 rows on 4 slots: rows wait, share their prompt's blocks and are preempted
    tight = dict(mode="auto", kv_block_size=16, continuous_batch_size=4, kv_cache_tokens=128, refill_rows=1,
                 profile=True)
    exact = Rollout(model, RolloutConfig(**(tight | {"mode": "paged"}))).generate(prompts, **call)
    rollout = Rollout(model, RolloutConfig(kv_cache_dtype="fp8", **tight))
    fp8 = rollout.generate(prompts, **call)
    assert fp8.route == "paged" and rollout.runner.stepper_info["kv_dtype"] == "fp8"
    assert rollout.runner.stepper.cache.keys[0].dtype == torch.uint8
    assert fp8.profile.num_preemptions > 0
    ratio = fp8.profile.kv_bytes_read_per_step / exact.profile.kv_bytes_read_per_step  # the same steps
    assert ratio == pytest.approx((16 + 4) / 16 / 4)  # fp32 values to a byte, plus 4 scale rows a block of 16
    assert [len(s) for s in fp8.sequences] == [24] * 12
    exact_max, _ = mismatch(exact, model)
    fp8_max, fp8_mean = mismatch(fp8, model)
    assert exact_max < 1e-4 < fp8_mean  # the rounding shows, and stays bounded
    assert fp8_max < 1.5 and fp8_mean < 0.2, (fp8_max, fp8_mean)


def test_the_prefix_cache_reads_fp8_blocks_back():
    model = get_tiny("qwen2")
    prompt = list(range(5, 45))  # two full blocks of 16, then a partial one
    rollout = Rollout(model, RolloutConfig(mode="paged", kv_block_size=16, prefix_cache=True, kv_cache_dtype="fp8",
                                           kv_cache_tokens=256, profile=True))  # one pool for both calls
    call = dict(max_new_tokens=8, return_logprobs=True, progress=False)
    first = rollout.generate([prompt + [3]], **call)
    second = rollout.generate([prompt + [4]], **call)
    assert second.profile.prefix_cache_hits == 32
    assert mismatch(first, model)[0] < 1.5 and mismatch(second, model)[0] < 1.5


@pytest.mark.parametrize("fields, message", [
    (dict(kv_cache_dtype="int8"), r"kv_cache_dtype must be one of \['auto', 'fp8'\], got 'int8'"),
    (dict(kv_cache_dtype="fp8", mode="bucketed"), "kv_cache_dtype='fp8' quantizes the paged pool; mode='bucketed'"),
    (dict(kv_cache_dtype="fp8", batch_invariant=True), "batch_invariant=True gives the trainer's exact logprobs"),
    (dict(kv_cache_dtype="fp8", shared_prefix_attention="on"), "shared_prefix_attention='on' must be 'auto' or 'off'"),
])
def test_settings_fp8_cannot_serve_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        RolloutConfig(**fields)


def test_the_compiled_step_writes_and_reads_the_fp8_pool_as_the_eager_step():
    """The layer-by-layer compiled forward (dynamo's aot_eager backend here) traces the FP8 write and
    the paged attention as the opaque ops they are: the same tokens as the eager step."""
    model = get_tiny("qwen3")
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    tokens = []
    for compiled in (False, True):
        key = StepperKey(2, 64, cache_kwarg_name(model), block_size=16, num_blocks=12, kv_dtype="fp8")
        stepper = EagerStepper(model, key)
        if compiled:
            stepper.forward = compile_forward(model, "layers", backend="aot_eager")
        stepper.reset()
        first, layer_kv = prefill_bucket(model, prompts, pad_token_id=0, cache_kwarg=cache_kwarg_name(model))
        for slot, prompt in enumerate(prompts):
            stepper.cache.grow(slot, len(prompt) + 8)
        stepper.cache.admit([0, 1], layer_kv, [5, 3])
        stepper.state.admit([0, 1], first.argmax(-1), [5, 3])
        with tracing():
            tokens.append([stepper.step(2, 0).tolist() for _ in range(6)])
        assert stepper.cache.keys[0].dtype == torch.uint8
    assert tokens[0] == tokens[1]


def test_episodes_and_partial_rollouts_keep_their_rows_in_an_fp8_pool():
    """The paths that move a row's KV on the host (a waiting episode's partial block kept outside the
    pool and written back, evicted history blocks, continuations resumed in a later call) run over an
    FP8 pool: every episode and every continued row ends, with its turns and budgets."""
    model = get_tiny("qwen2")
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, TINY_VOCAB_SIZE, (int(n),), generator=gen).tolist() for n in (20, 5, 33, 12, 18, 9)]
    stops = sorted({s[2] for s in Rollout(model, RolloutConfig(mode="paged", kv_block_size=16)).generate(
        prompts, max_new_tokens=4, progress=False).sequences})[:3]

    def env(request, sample, tokens):
        return [(tokens[-1] * 7 + request + k) % (TINY_VOCAB_SIZE - 3) + 3 for k in range(1 + len(tokens) % 3)]

    tight = dict(mode="paged", kv_block_size=16, continuous_batch_size=3, kv_cache_tokens=96, refill_rows=1,
                 kv_cache_dtype="fp8", profile=True)
    out = Rollout(model, RolloutConfig(**tight)).generate(prompts, max_new_tokens=40, stop_token_ids=stops, env=env,
                                                          max_turns=4, max_env_tokens=9, progress=False)
    assert out.profile.num_env_calls >= 2 and out.profile.num_preemptions > 0
    assert max(out.num_turns) > 1 and all(1 <= t <= 4 for t in out.num_turns)
    for tokens, mask in zip(out.sequences, out.env_masks):
        assert len(tokens) == len(mask) and mask.count(False) <= 40
    # partial rollouts over the tight pool (preemption, prefill across turns), continued to the end
    prompts = make_prompts(6, seed=1, lengths=(10, 22))
    eos = eos_of(model, prompts, PAGED, num_samples=2, **SAMPLED)
    cfg = RolloutConfig(**TIGHT, eos_token_id=eos, kv_cache_dtype="fp8")
    got, results = continued(Rollout(model, cfg), prompts, (0.25, 0.5, None), max_new_tokens=BUDGET, num_samples=2,
                             **SAMPLED)
    assert len(results) >= 2 and results[1].profile.num_continued_rows > 0
    assert any(len(segments) > 1 for _, _, segments in got)
    for tokens, logprobs, segments in got:
        assert sum(n for _, n in segments) == len(tokens) == len(logprobs) <= BUDGET
