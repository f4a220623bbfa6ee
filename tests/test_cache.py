"""The right-aligned static KV cache: span copies, shifts, compaction and the decode-step view."""
from __future__ import annotations

import pytest
import torch
from conftest import get_tiny

from rollout_lab.engine.kv.aligned import AlignedKVCache
from rollout_lab.engine.runner.prefill import cache_kwarg_name, prefill_bucket


def small_cache(**overrides) -> AlignedKVCache:
    kwargs = dict(num_layers=2, num_slots=3, num_kv_heads=1, head_dim=2, capacity=10,
                  dtype=torch.float32, device="cpu")
    kwargs.update(overrides)
    return AlignedKVCache(**kwargs)


def bucket_kv(rows: int, width: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, 1, width, 2, generator=g) + 1, torch.randn(rows, 1, width, 2, generator=g) + 1)
            for _ in range(2)]


def test_admit_copies_effective_spans_right_aligned():
    cache = small_cache()
    cache.set_front(6)
    kv = bucket_kv(2, 4)
    cache.admit([2, 0], kv, [4, 2])
    for layer, (k, v) in enumerate(kv):
        assert torch.equal(cache.keys[layer][2, :, 2:6], k[0])
        assert torch.equal(cache.values[layer][0, :, 4:6], v[1, :, 2:4])
        assert not cache.keys[layer][0, :, :4].any()  # row 1's left padding was not copied
        assert not cache.keys[layer][1].any()
    attend = cache.mask[:, 0, 0] == 0
    assert attend[2].tolist() == [False] * 2 + [True] * 4 + [False] * 4
    assert attend[0].tolist() == [False] * 4 + [True] * 2 + [False] * 4
    assert not attend[1].any()
    assert cache.row_starts[2] == 2 and cache.row_starts[0] == 4


def test_admit_needs_room_left_of_front():
    cache = small_cache()
    cache.set_front(3)
    with pytest.raises(RuntimeError, match="front"):
        cache.admit([0], bucket_kv(1, 4), [4])


@pytest.mark.parametrize("delta", [-2, 3])
def test_shift_columns_moves_data_mask_and_front(delta):
    cache = small_cache()
    cache.set_front(6)
    cache.admit([0, 1], bucket_kv(2, 4), [4, 3])
    before_k = cache.keys[1][:2, :, 2:6].clone()
    before_mask = cache.mask[:2, ..., 2:6].clone()
    moved = cache.shift_columns(2, delta)
    assert cache.front_int == 6 + delta and cache.front.item() == 6 + delta
    assert torch.equal(cache.keys[1][:2, :, 2 + delta:6 + delta], before_k)
    assert torch.equal(cache.mask[:2, ..., 2 + delta:6 + delta], before_mask)
    assert int((cache.mask[:2] == 0).sum()) == 7
    assert cache.row_starts[:2] == [2 + delta, 3 + delta]
    assert moved == 2 * 4 * cache.column_bytes


def test_shift_columns_refuses_to_leave_the_buffer():
    cache = small_cache()
    cache.set_front(6)
    cache.admit([0], bucket_kv(1, 4), [4])
    with pytest.raises(RuntimeError, match="capacity"):
        cache.shift_columns(1, -3)
    with pytest.raises(RuntimeError, match="capacity"):
        cache.shift_columns(1, 5)


def test_move_rows_compacts():
    cache = small_cache()
    cache.set_front(5)
    kv = bucket_kv(3, 5)
    cache.admit([0, 1, 2], kv, [5, 2, 3])
    moved = cache.move_rows([2], [0])
    assert torch.equal(cache.keys[0][0, :, 2:5], kv[0][0][2, :, 2:5])
    assert torch.equal(cache.mask[0], cache.mask[2])
    assert cache.row_starts[0] == 2
    assert moved == 3 * cache.column_bytes


def test_sizes():
    cache = small_cache()
    assert cache.column_bytes == 2 * 2 * 1 * 2 * 4
    assert cache.num_bytes == cache.column_bytes * 3 * 10


def test_layer_writes_at_front_without_advancing():
    cache = small_cache()
    cache.set_front(4)
    view = cache.hf_cache(2)
    assert view is cache.hf_cache(2)  # memoised: one static object per row count
    k, v = torch.ones(2, 1, 1, 2), torch.full((2, 1, 1, 2), 2.0)
    keys, values = view.update(k, v, 1)
    assert keys.shape == (2, 1, 10, 2)
    assert torch.equal(cache.keys[1][:2, :, 4:5], k) and torch.equal(cache.values[1][:2, :, 4:5], v)
    assert not cache.keys[1][2].any()  # slots past the view untouched
    view.update(k, v, 1)  # a replay (graph warm-up) rewrites the same column
    assert cache.front.item() == 4 and int(view.get_seq_length()) == 4
    with pytest.raises(RuntimeError, match="one decode token"):
        view.update(torch.ones(2, 1, 3, 2), torch.ones(2, 1, 3, 2), 0)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama", "opt"])
def test_decode_forward_over_aligned_cache_matches_full_forward(family):
    # rows of different lengths, right-aligned at front 9 of capacity 12 with stale data on the left
    model = get_tiny(family)
    name = cache_kwarg_name(model)
    prompts = [[5, 9, 17, 3, 8], [44, 2], [7, 7, 100, 31, 2, 250, 11]]
    cache = AlignedKVCache.for_model(model, num_slots=3, capacity=12)
    for k in cache.keys:
        k.normal_()  # stale, finite garbage must stay masked
    cache.set_front(9)
    with torch.no_grad():
        _, kv = prefill_bucket(model, prompts, pad_token_id=0, cache_kwarg=name)
        cache.admit([0, 1, 2], kv, [len(p) for p in prompts])
        nxt = torch.tensor([[12], [13], [14]])
        mask = cache.mask
        mask.index_fill_(3, cache.front, 0.0)
        out = model(input_ids=nxt, position_ids=torch.tensor([[5], [2], [7]]), attention_mask=mask,
                    use_cache=True, **{name: cache.hf_cache(3)})
        for row, prompt in enumerate(prompts):
            full = model(input_ids=torch.tensor([prompt + [12 + row]])).logits[0, -1]
            torch.testing.assert_close(out.logits[row, -1], full, rtol=1e-4, atol=1e-4)
    assert cache.front.item() == 9  # the forward itself does not advance the front
