"""The decode read's KV bytes (planner.kv_reads): the plain and the shared read, and where reading a
group's shared prefix once pays."""
from __future__ import annotations

import pytest

from rollout_lab.planner.cost import ModelGeometry
from rollout_lab.planner.kv_reads import (
    EXTRA_LAUNCHES, LAUNCH_COST_BYTES, PREFIX_TILE_QUERIES, kv_bytes_read, prefix_reads, prefix_tile_rows,
    shared_prefix_pays, shared_read_saving_bytes,
)

QWEN = ModelGeometry.qwen25_3b(element_bytes=2)  # 16 query heads over 2 KV heads: 8 per KV head
MHA = ModelGeometry(4, 8, 8, 64, 2)
PER_TOKEN = 2 * 36 * 2 * 128 * 2  # K and V, every layer, bf16


def test_a_tile_holds_the_query_heads_of_a_groups_rows():
    assert QWEN.kv_bytes_per_token == PER_TOKEN
    assert prefix_tile_rows(QWEN) == PREFIX_TILE_QUERIES // 8 == 16
    assert prefix_tile_rows(MHA) == PREFIX_TILE_QUERIES
    assert prefix_tile_rows(ModelGeometry(2, 28, 4, 128, 2)) == 16  # 7 per KV head: padded to 8
    assert prefix_tile_rows(ModelGeometry(2, 512, 1, 64, 2)) == 1
    assert [prefix_reads(rows, QWEN) for rows in (1, 16, 17, 32, 33)] == [1, 1, 2, 2, 3]


def test_the_plain_read_reads_every_rows_context():
    assert kv_bytes_read(0, QWEN) == 0
    assert kv_bytes_read(512 * 2_200, QWEN) == 512 * 2_200 * PER_TOKEN


def test_the_shared_read_reads_a_prefix_once_per_tile_of_its_group():
    """The issue's shape: 32 groups x 16 rows sharing 1,984 prompt tokens (31 blocks of 64), each row
    at 2,000 + 300 tokens: the plain read takes the prefix 16 times, the shared read once."""
    context = 512 * 2_300
    shared = kv_bytes_read(context, QWEN, prefix_tokens=[1_984] * 32, group_rows=[16] * 32)
    assert shared == (context - 32 * 15 * 1_984) * PER_TOKEN
    assert kv_bytes_read(context, QWEN) / shared > 5
    # one group: ints; a group over two tiles reads its prefix twice
    assert kv_bytes_read(17 * 100, QWEN, prefix_tokens=64, group_rows=17) == (17 * 100 - 17 * 64 + 2 * 64) * PER_TOKEN
    assert kv_bytes_read(300, QWEN, prefix_tokens=[0, 64], group_rows=[3, 1]) == 300 * PER_TOKEN  # nothing spared


def test_kv_bytes_read_refuses_what_cannot_be():
    with pytest.raises(ValueError, match="hold 1024 prefix tokens, more than context_tokens=1000"):
        kv_bytes_read(1_000, QWEN, prefix_tokens=[512], group_rows=[2])
    with pytest.raises(ValueError, match="prefix_tokens has 2 groups and group_rows 1"):
        kv_bytes_read(1_000, QWEN, prefix_tokens=[64, 64], group_rows=[2])
    with pytest.raises(ValueError, match="must both be ints .* or both lists"):
        kv_bytes_read(1_000, QWEN, prefix_tokens=64, group_rows=[2])
    with pytest.raises(ValueError, match=r"group_rows\[0\] must be an int >= 1, got 0"):
        kv_bytes_read(1_000, QWEN, prefix_tokens=[64], group_rows=[0])
    with pytest.raises(ValueError, match=r"prefix_tokens\[1\] must be an int >= 0, got -64"):
        kv_bytes_read(1_000, QWEN, prefix_tokens=[64, -64], group_rows=[1, 1])
    with pytest.raises(ValueError, match="context_tokens must be an int >= 0, got 1.5"):
        kv_bytes_read(1.5, QWEN)
    with pytest.raises(ValueError, match="geometry must be a ModelGeometry, got 'qwen'"):
        kv_bytes_read(1, "qwen")


def test_the_saving_is_the_spared_reads_less_partials_and_launches():
    partial = 2 * 4 * (128 + 2) * 16 * 36  # per row and prefix split: fp32 max, sum, output, written and read
    got = shared_read_saving_bytes([1_984] * 32, [16] * 32, QWEN, prefix_splits=9, ungrouped_rows=4,
                                   launch_cost_bytes=1_000)
    assert got == 32 * 15 * 1_984 * PER_TOKEN - (512 + 4) * 9 * partial - EXTRA_LAUNCHES * 36 * 1_000
    assert shared_read_saving_bytes(64, 1, QWEN, prefix_splits=1, launch_cost_bytes=0) == -partial  # nothing spared


def test_the_shared_read_pays_for_long_shared_prompts_only():
    assert shared_prefix_pays([1_984] * 32, [16] * 32, QWEN, prefix_splits=9)  # the shape
    assert shared_prefix_pays([1_984] * 4, [16] * 4, QWEN, prefix_splits=32)
    assert not shared_prefix_pays(1_984, 16, QWEN, prefix_splits=32)  # one group: its launches cost more
    assert not shared_prefix_pays(64, 2, QWEN, prefix_splits=1)  # one block, two rows: the launches cost more
    assert shared_prefix_pays(64, 2, QWEN, prefix_splits=1, launch_cost_bytes=0)
    assert not shared_prefix_pays([1_984] * 4, [1] * 4, QWEN, prefix_splits=4)  # groups of one: nothing spared
    assert not shared_prefix_pays([0] * 4, [16] * 4, QWEN, prefix_splits=1)  # no prefix
    # it pays from some prefix length on, and stays paying past it
    pays = [shared_prefix_pays([64 * blocks] * 4, [8] * 4, QWEN, prefix_splits=4) for blocks in range(0, 64)]
    assert not pays[0] and pays[-1] and pays == sorted(pays)


def test_the_price_refuses_bad_knobs():
    with pytest.raises(ValueError, match="prefix_splits must be an int >= 1, got 0"):
        shared_prefix_pays(64, 2, QWEN, prefix_splits=0)
    with pytest.raises(ValueError, match="ungrouped_rows must be an int >= 0, got -1"):
        shared_prefix_pays(64, 2, QWEN, prefix_splits=1, ungrouped_rows=-1)
    for bad in (-1.0, float("inf"), True, "8"):
        with pytest.raises(ValueError, match=f"launch_cost_bytes must be a finite number >= 0, got {bad!r}"):
            shared_prefix_pays(64, 2, QWEN, prefix_splits=1, launch_cost_bytes=bad)
    assert LAUNCH_COST_BYTES > 0
