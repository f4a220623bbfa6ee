"""Decode attention over a paged KV cache whose rows share prompt blocks: the shared prefix is read
once per group, each row's own suffix once per row, and the two merged by log-sum-exp.

The samples of one prompt (a group) hold the prompt's full KV blocks once (``engine.kv.paged``'s
reference-counted blocks): every member's block table points at the same physical blocks for its
first ``prefix_len[g] // block_size`` logical blocks. ``engine.kernels.paged`` reads them once per
row; this two-level read takes them once per group:

- level 1, one program per (group, KV head, split of the prefix): it finds the group's rows on the
  device (``group_of_row``), loads their query heads of the KV head as one tile of up to
  ``PREFIX_TILE_QUERIES`` (rows × query heads, ``[tile, head_dim]``), and runs an online softmax
  over its part of the group's prefix blocks (``prefix_blocks[g]``), so each block is read once and
  multiplied as a matrix (tensor cores on a GPU). A group larger than a tile goes through it tile
  by tile, reading its prefix once per tile. Each (row, query head) gets a max, a sum and an
  unnormalised output, masked at the row's own position;
- level 2, one program per (row, KV head, split): ``paged``'s block loop over the row's own blocks
  from ``prefix_len // block_size`` to its position, through its table;
- ``span``'s merge kernel combines the prefix splits and the suffix splits of each (row, KV head).

A row whose group is -1 (or past the last group) has no shared prefix: level 2 reads all its blocks,
and writes the weight-0 partials of its prefix splits. The result equals ``paged_attention`` over the
rows' tables whenever the tables' first ``prefix_len // block_size`` entries are the group's prefix
blocks (how the cache holds them); ``shared_prefix_attention_reference`` is that read, in torch.
Half-precision caches go into the tensor cores as in ``paged``; under Triton's CPU interpreter they
are upcast to fp32.

The indices (positions, tables, groups, prefix blocks and lengths) are device tensors read in the
kernels, and the grids depend only on shapes (rows, groups, blocks per row, prefix blocks per
group), so the launches can be captured in a CUDA graph. It is a ``torch.library`` custom op::

    out = shared_prefix_attention(query, key_pool, value_pool, block_tables, positions,
                                  group_of_row, prefix_blocks, prefix_len, scale)   # [rows, 1, heads, head_dim]

``query``, the pools, ``block_tables`` and ``positions`` as ``paged_attention`` takes them;
``group_of_row`` ``[>= rows]`` integer (-1: no group); ``prefix_blocks`` ``[groups,
max_prefix_blocks]`` integer, a group's shared full blocks in logical order; ``prefix_len``
``[groups]`` integer, tokens (a multiple of ``block_size``; a remainder is read as suffix). Whether
the shared read pays for a step is ``planner.kv_reads.shared_prefix_pays``.

"""
from __future__ import annotations

import torch

from rollout_lab.engine.kernels.available import kernel_available, tl, triton
from rollout_lab.engine.kernels.paged import _check as _check_paged
from rollout_lab.engine.kernels.paged import paged_attention_reference, paged_splits
from rollout_lab.engine.kernels.span import MAX_SPLITS, merge_splits, split_buffers
from rollout_lab.planner.kv_reads import PREFIX_TILE_QUERIES

OP_NAME = "rollout_lab::shared_prefix_attention"
# RolloutConfig.shared_prefix_attention: whether the paged decode reads shared prompt blocks once per group
SHARED_PREFIX_ATTENTIONS = ("auto", "on", "off")
SCAN_ROWS = 128  # group_of_row entries a level-1 program reads per step of its search for members


def prefix_splits(groups: int, kv_heads: int, max_prefix_blocks: int, device: torch.device | str) -> int:
    """Splits of each group's prefix: as many as keep the level-1 programs within one wave of the
    GPU's multiprocessors (each split adds a partial per row and query head, written and merged, and a
    second, partial wave leaves most of the GPU idle at its end: on an H100, 32 groups x 2 KV heads
    read fastest at 2 splits, of 1-9, data/diagnostics/shared_prefix_kernel_splits_h100_f4f6e4f.txt),
    at least 1, at most ``MAX_SPLITS``, and no more than a prefix has blocks."""
    device = torch.device(device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    wanted = sms // max(1, groups * kv_heads)
    return max(1, min(wanted, MAX_SPLITS, max_prefix_blocks))


def shared_tables(block_tables: torch.Tensor, group_of_row: torch.Tensor, prefix_blocks: torch.Tensor,
                  prefix_len: torch.Tensor, *, rows: int, block_size: int) -> torch.Tensor:
    """Each row's block table with its first ``prefix_len // block_size`` entries taken from its group's
    ``prefix_blocks`` (rows of group -1, or past the last group, keep theirs); [rows, max(max_blocks,
    max_prefix_blocks)] int64, padded with the scratch block 0."""
    groups, max_prefix = prefix_blocks.shape
    width = max(block_tables.shape[1], max_prefix)
    table = torch.zeros(rows, width, dtype=torch.long, device=block_tables.device)
    table[:, : block_tables.shape[1]] = block_tables[:rows].to(torch.long)
    group = group_of_row[:rows].to(torch.long)
    shared = (group >= 0) & (group < groups)  # [rows]
    safe = torch.where(shared, group, 0)
    count = torch.where(shared, torch.clamp(prefix_len.to(torch.long)[safe] // block_size, max=max_prefix), 0)
    prefix = torch.zeros(rows, width, dtype=torch.long, device=block_tables.device)
    prefix[:, :max_prefix] = prefix_blocks.to(torch.long)[safe]
    cols = torch.arange(width, device=block_tables.device)
    return torch.where(cols[None, :] < count[:, None], prefix, table)  # [rows, width]


def shared_prefix_attention_reference(
    query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor, block_tables: torch.Tensor,
    positions: torch.Tensor, group_of_row: torch.Tensor, prefix_blocks: torch.Tensor, prefix_len: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Torch reference: ``paged_attention_reference`` through each row's table with its group's
    prefix blocks in front (``shared_tables``)."""
    rows = query.shape[0]
    table = shared_tables(block_tables, group_of_row, prefix_blocks, prefix_len, rows=rows,
                          block_size=key_pool.shape[1])
    return paged_attention_reference(query, key_pool, value_pool, table, positions, scale)


if triton is not None:
    from rollout_lab.engine.kernels.paged import _paged_blocks
    from rollout_lab.engine.kernels.span import _store_split

    @triton.jit
    def _tile_rows(GroupOfRow, stride_gr, rows, group, first, TILE_ROWS: tl.constexpr, SCAN: tl.constexpr):
        """The rows of ``group``'s members ``first .. first + TILE_ROWS - 1`` (in row order), -1 past
        its last member: [TILE_ROWS] int32."""
        want = first + tl.arange(0, TILE_ROWS)
        found = tl.zeros([TILE_ROWS], dtype=tl.int32)  # row + 1 of each wanted member, 0 if none
        seen = 0
        for start in range(0, rows, SCAN):
            r = start + tl.arange(0, SCAN)
            member = tl.load(GroupOfRow + r * stride_gr, mask=r < rows, other=-1) == group
            rank = seen + tl.cumsum(member.to(tl.int32), 0) - 1  # [SCAN]: each member's index in the group
            hit = member[None, :] & (rank[None, :] == want[:, None])  # [TILE_ROWS, SCAN]
            found += tl.sum(tl.where(hit, r[None, :] + 1, 0), 1)
            seen += tl.sum(member.to(tl.int32), 0)
        return found - 1

    @triton.jit
    def _prefix_partial(
        Q, K, V, Positions, GroupOfRow, PrefixBlocks, PrefixLen, M, L, Acc,
        stride_qb, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
        stride_p, stride_gr, stride_pb, stride_pn, stride_pl, rows, max_prefix_blocks, scale,
        KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr, GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_ROWS: tl.constexpr, SCAN: tl.constexpr,
        SPLITS: tl.constexpr, PRECISION: tl.constexpr, NATIVE_QK: tl.constexpr, NATIVE_PV: tl.constexpr,
    ):
        pid = tl.program_id(0)  # group * KV_HEADS + kv head
        split = tl.program_id(1)  # of the prefix: the partials' splits [0, num_programs(1))
        group = pid // KV_HEADS
        head = pid % KV_HEADS
        blocks = tl.minimum(tl.load(PrefixLen + group * stride_pl).to(tl.int32) // BLOCK_SIZE, max_prefix_blocks)
        part = tl.cdiv(blocks, tl.num_programs(1))
        lo = split * part
        hi = tl.minimum(lo + part, blocks)

        members = 0
        for start in range(0, rows, SCAN):
            r = start + tl.arange(0, SCAN)
            members += tl.sum((tl.load(GroupOfRow + r * stride_gr, mask=r < rows, other=-1) == group).to(tl.int32), 0)
        i = tl.arange(0, TILE_ROWS * GROUP_P2)  # the tile: member i // GROUP_P2, query head i % GROUP_P2
        g = i % GROUP_P2
        d = tl.arange(0, HEAD_DIM)
        t = tl.arange(0, BLOCK_SIZE)
        k_head = K + head * stride_kh + t[:, None] * stride_kn + d[None, :]  # [BLOCK_SIZE, HEAD_DIM]
        v_head = V + head * stride_vh + t[:, None] * stride_vn + d[None, :]
        prefix = PrefixBlocks + group * stride_pb
        for first in range(0, members, TILE_ROWS):
            member_rows = _tile_rows(GroupOfRow, stride_gr, rows, group, first, TILE_ROWS, SCAN)
            row = tl.reshape(tl.broadcast_to(member_rows[:, None], (TILE_ROWS, GROUP_P2)), (TILE_ROWS * GROUP_P2,))
            real = (row >= 0) & (g < GROUP)
            row = tl.where(real, row, 0).to(tl.int64)
            end = tl.where(real, tl.load(Positions + row * stride_p, mask=real, other=0).to(tl.int32) + 1, 0)
            q = tl.load(Q + row[:, None] * stride_qb + (head * GROUP + g)[:, None] * stride_qh + d[None, :],
                        mask=real[:, None], other=0.0)  # [TILE, HEAD_DIM]
            if not NATIVE_QK:
                q = q.to(tl.float32)
            m = tl.full([TILE_ROWS * GROUP_P2], float("-inf"), dtype=tl.float32)
            s = tl.zeros([TILE_ROWS * GROUP_P2], dtype=tl.float32)
            acc = tl.zeros([TILE_ROWS * GROUP_P2, HEAD_DIM], dtype=tl.float32)
            for block in range(lo, hi):
                phys = tl.load(prefix + block * stride_pn).to(tl.int64)
                k = tl.load(k_head + phys * stride_kb)  # a prefix block is full: no mask
                if NATIVE_QK:
                    qk = tl.dot(q, tl.trans(k)) * scale  # [TILE, BLOCK_SIZE]
                else:
                    qk = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=PRECISION) * scale
                # a row before the end of the prefix (or a padded entry: end 0) sees none of what follows
                qk = tl.where(block * BLOCK_SIZE + t[None, :] < end[:, None], qk, float("-inf"))
                m_new = tl.maximum(m, tl.max(qk, 1))
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing live yet: p = 0
                p = tl.exp(qk - m_use[:, None])
                alpha = tl.exp(m - m_use)
                v = tl.load(v_head + phys * stride_vb)
                if NATIVE_PV:
                    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                else:
                    acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=PRECISION)
                s = s * alpha + tl.sum(p, 1)
                m = m_new
            out = ((row * KV_HEADS + head) * SPLITS + split) * GROUP_PAD + g  # [TILE] rows of the partials
            tl.store(M + out, m, mask=real)
            tl.store(L + out, s, mask=real)
            tl.store(Acc + out[:, None] * HEAD_DIM + d[None, :], acc, mask=real[:, None])

    @triton.jit
    def _suffix_partial(
        Q, K, V, Tables, Positions, GroupOfRow, PrefixLen, M, L, Acc, Out,
        stride_qb, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
        stride_tb, stride_tn, stride_p, stride_gr, stride_pl, stride_ob, stride_oh,
        groups, max_blocks, max_prefix_blocks, scale,
        KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, PREFIX_SPLITS: tl.constexpr, SPLITS: tl.constexpr, PRECISION: tl.constexpr,
        NATIVE_QK: tl.constexpr, NATIVE_PV: tl.constexpr,
    ):
        pid = tl.program_id(0)  # row * KV_HEADS + kv head
        split = tl.program_id(1)  # of the suffix: the partials' splits [PREFIX_SPLITS, SPLITS)
        row = pid // KV_HEADS
        head = pid % KV_HEADS
        end = tl.load(Positions + row * stride_p).to(tl.int32) + 1
        group = tl.load(GroupOfRow + row * stride_gr).to(tl.int32)
        shared = (group >= 0) & (group < groups)
        prefix_len = tl.load(PrefixLen + group * stride_pl, mask=shared, other=0).to(tl.int32)
        first = tl.minimum(prefix_len // BLOCK_SIZE, max_prefix_blocks)  # level 1 reads the blocks before
        blocks = tl.minimum(tl.cdiv(end, BLOCK_SIZE), max_blocks)
        part = tl.cdiv(tl.maximum(blocks - first, 0), tl.num_programs(1))
        lo = first + split * part
        hi = tl.minimum(lo + part, blocks)

        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, HEAD_DIM)
        t = tl.arange(0, BLOCK_SIZE)
        q = tl.load(Q + row * stride_qb + (head * GROUP + g)[:, None] * stride_qh + d[None, :],
                    mask=g[:, None] < GROUP, other=0.0)  # [GROUP_PAD, HEAD_DIM]
        if not NATIVE_QK:
            q = q.to(tl.float32)
        k_head = K + head * stride_kh + t[:, None] * stride_kn + d[None, :]
        v_head = V + head * stride_vh + t[:, None] * stride_vn + d[None, :]
        m, s, acc = _paged_blocks(q, k_head, v_head, Tables + row * stride_tb, stride_kb, stride_vb, stride_tn,
                                  lo, hi, end, scale, GROUP_PAD, HEAD_DIM, BLOCK_SIZE, PRECISION,
                                  NATIVE_QK, NATIVE_PV, k_head, v_head, 0, False)  # bf16/fp32 pools only
        _store_split(M, L, Acc, Out, stride_ob, stride_oh, m, s, acc, pid, PREFIX_SPLITS + split, row, head,
                     GROUP, GROUP_PAD, HEAD_DIM, SPLITS)
        if ((group < 0) | (group >= groups)) & (split == 0):  # no level-1 program writes its prefix partials
            none = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)  # weight 0 in the merge
            for prefix_split in tl.static_range(PREFIX_SPLITS):
                _store_split(M, L, Acc, Out, stride_ob, stride_oh, none, tl.zeros([GROUP_PAD], dtype=tl.float32),
                             tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32), pid, prefix_split, row, head,
                             GROUP, GROUP_PAD, HEAD_DIM, SPLITS)


def _is_int_tensor(tensor: torch.Tensor) -> bool:
    return not tensor.dtype.is_floating_point and not tensor.dtype.is_complex and tensor.dtype != torch.bool


def _check(
    query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor, block_tables: torch.Tensor,
    positions: torch.Tensor, group_of_row: torch.Tensor, prefix_blocks: torch.Tensor, prefix_len: torch.Tensor,
) -> None:
    _check_paged(query, key_pool, value_pool, block_tables, positions)
    rows = query.shape[0]
    if group_of_row.dim() != 1 or not _is_int_tensor(group_of_row) or group_of_row.shape[0] < rows:
        raise ValueError(f"group_of_row must be an integer [>= rows] tensor (-1: no group) for {rows} rows, got "
                         f"{group_of_row.dtype} {tuple(group_of_row.shape)}")
    if prefix_blocks.dim() != 2 or not _is_int_tensor(prefix_blocks) or min(prefix_blocks.shape) < 1:
        raise ValueError(f"prefix_blocks must be an integer [groups >= 1, max_prefix_blocks >= 1] tensor, got "
                         f"{prefix_blocks.dtype} {tuple(prefix_blocks.shape)}")
    if prefix_len.dim() != 1 or not _is_int_tensor(prefix_len) or prefix_len.shape[0] != prefix_blocks.shape[0]:
        raise ValueError(f"prefix_len must be an integer [groups] tensor, {prefix_blocks.shape[0]} entries as "
                         f"prefix_blocks has groups, got {prefix_len.dtype} {tuple(prefix_len.shape)}")


@torch.library.custom_op(OP_NAME, mutates_args=())
def shared_prefix_attention(
    query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor, block_tables: torch.Tensor,
    positions: torch.Tensor, group_of_row: torch.Tensor, prefix_blocks: torch.Tensor, prefix_len: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of each row's one query token over its paged positions ``[0, positions[i]]``, its
    group's shared prefix read once per group; [rows, 1, heads, head_dim], in ``query``'s dtype."""
    if key_pool.dtype == torch.uint8 or value_pool.dtype == torch.uint8:
        raise ValueError("the shared-prefix read does not take FP8 pools (kv_cache_dtype='fp8'): use "
                         "engine.kernels.paged.paged_attention")
    _check(query, key_pool, value_pool, block_tables, positions, group_of_row, prefix_blocks, prefix_len)
    if not kernel_available(query.device):
        return shared_prefix_attention_reference(query, key_pool, value_pool, block_tables, positions,
                                                 group_of_row, prefix_blocks, prefix_len, scale)
    rows, heads, _, head_dim = query.shape
    block_size, kv_heads = key_pool.shape[1], key_pool.shape[2]
    groups, max_prefix_blocks = prefix_blocks.shape
    max_blocks = block_tables.shape[1]
    group = heads // kv_heads
    group_pad = max(16, triton.next_power_of_2(group))  # the merge's layout, as paged's
    group_p2 = triton.next_power_of_2(group)
    tile_rows = max(1, PREFIX_TILE_QUERIES // group_p2)
    first_splits = prefix_splits(groups, kv_heads, max_prefix_blocks, query.device)
    suffix_splits = paged_splits(rows, kv_heads, max_blocks, query.device)
    splits = first_splits + suffix_splits
    if key_pool.stride(-1) != 1 or value_pool.stride(-1) != 1:  # a copy of the pool: avoid on the hot path
        key_pool, value_pool = key_pool.contiguous(), value_pool.contiguous()
    query = query.contiguous()
    m, s, acc, out = split_buffers(query, kv_heads, splits, group_pad)
    native = query.dtype in (torch.bfloat16, torch.float16) and query.device.type == "cuda"  # as paged's
    strides = (query.stride(0), query.stride(1), key_pool.stride(0), key_pool.stride(1), key_pool.stride(2),
               value_pool.stride(0), value_pool.stride(1), value_pool.stride(2))
    _prefix_partial[(groups * kv_heads, first_splits)](
        query, key_pool, value_pool, positions, group_of_row, prefix_blocks, prefix_len, m, s, acc,
        *strides, positions.stride(0), group_of_row.stride(0), prefix_blocks.stride(0), prefix_blocks.stride(1),
        prefix_len.stride(0), rows, max_prefix_blocks, scale,
        KV_HEADS=kv_heads, GROUP=group, GROUP_P2=group_p2, GROUP_PAD=group_pad, HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, TILE_ROWS=tile_rows, SCAN=SCAN_ROWS, SPLITS=splits, PRECISION="ieee",
        NATIVE_QK=native, NATIVE_PV=native, num_warps=8 if tile_rows * group_p2 >= 128 else 4, num_stages=2,
    )
    _suffix_partial[(rows * kv_heads, suffix_splits)](
        query, key_pool, value_pool, block_tables, positions, group_of_row, prefix_len, m, s, acc, out,
        *strides, block_tables.stride(0), block_tables.stride(1), positions.stride(0), group_of_row.stride(0),
        prefix_len.stride(0), out.stride(0), out.stride(2), groups, max_blocks, max_prefix_blocks, scale,
        KV_HEADS=kv_heads, GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        PREFIX_SPLITS=first_splits, SPLITS=splits, PRECISION="ieee", NATIVE_QK=native, NATIVE_PV=native,
        num_warps=4, num_stages=2,
    )
    return merge_splits(m, s, acc, out, kv_heads=kv_heads, group=group, group_pad=group_pad, splits=splits)


@shared_prefix_attention.register_fake
def _(query, key_pool, value_pool, block_tables, positions, group_of_row, prefix_blocks, prefix_len, scale):
    rows, heads, _, head_dim = query.shape
    return query.new_empty(rows, 1, heads, head_dim)
