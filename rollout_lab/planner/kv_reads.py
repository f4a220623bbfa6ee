"""The KV bytes a paged decode step's attention reads, and whether reading shared prefixes once pays.

On the paged route the samples of a prompt (a group) point at the prompt's full KV blocks. The plain
read (``engine.kernels.paged``) still reads them once per row; the shared read
(``engine.kernels.shared_prefix``) reads a group's prefix once per tile of its rows (a tile holds
``PREFIX_TILE_QUERIES`` query heads: rows × query heads per KV head) and each row's own suffix once.
It pays for that with its prefix partials (a max, a sum and an unnormalised output per row, query
head, layer and prefix split, written by the prefix kernel and read by the merge) and with two more
launches per layer (the prefix kernel and the merge)::

    g = ModelGeometry.qwen25_3b(element_bytes=2)
    kv_bytes_read(context_tokens=512 * 2_200, geometry=g)                     # the plain read, a step
    kv_bytes_read(context_tokens=512 * 2_200, geometry=g, prefix_tokens=[1_984] * 32, group_rows=[16] * 32)
    shared_prefix_pays([1_984] * 32, [16] * 32, g, prefix_splits=9)            # True

Bytes, not times: the decode step is bound by HBM, so the read that moves fewer bytes is the faster
one, and a launch is priced as the bytes HBM moves while it starts (``launch_cost_bytes``). Pure
Python.
"""
from __future__ import annotations

from typing import Sequence

from rollout_lab.planner.checks import check_int
from rollout_lab.planner.cost import ModelGeometry

# query heads (a group's rows × the query heads of one KV head) one prefix program multiplies against
# a block at once; a larger group reads its prefix once per tile. The kernel's tile (engine.kernels.
# shared_prefix): its fp32 accumulator, [tile, head_dim], fits 8 warps' registers at head_dim 128
PREFIX_TILE_QUERIES = 128
PARTIAL_BYTES = 4  # the partials are fp32
EXTRA_LAUNCHES = 2  # per layer: the prefix kernel and the merge (the suffix kernel replaces the plain one)
# an extra launch priced as the bytes the plain read moves in the time it costs: the shared read with
# no group against the plain read, less its partials' traffic, per extra launch (the "launch_cost_bytes"
# of scripts/gpu/shared_prefix_kernel.py's record: 20.6-21.8 MiB on an H100,
# data/diagnostics/shared_prefix_kernel_h100_f054475.json)
LAUNCH_COST_BYTES = 20 * 2**20


def prefix_tile_rows(geometry: ModelGeometry) -> int:
    """A group's rows per prefix tile: ``PREFIX_TILE_QUERIES`` over the query heads per KV head (a
    power of two, as the kernel pads them), at least 1."""
    per_kv = geometry.num_query_heads // geometry.num_kv_heads
    return max(1, PREFIX_TILE_QUERIES // (1 << (per_kv - 1).bit_length()))


def _groups(prefix_tokens: int | Sequence[int], group_rows: int | Sequence[int]) -> list[tuple[int, int]]:
    """(prefix tokens, rows) per group: ints for one group, or one int per group of each."""
    if isinstance(prefix_tokens, (list, tuple)) != isinstance(group_rows, (list, tuple)):
        raise ValueError(f"prefix_tokens {prefix_tokens!r} and group_rows {group_rows!r} must both be ints (one "
                         "group) or both lists (one entry per group)")
    if not isinstance(prefix_tokens, (list, tuple)):
        prefix_tokens, group_rows = [prefix_tokens], [group_rows]
    if len(prefix_tokens) != len(group_rows):
        raise ValueError(f"prefix_tokens has {len(prefix_tokens)} groups and group_rows {len(group_rows)}; "
                         "give one entry per group in each")
    return [(check_int(p, name=f"prefix_tokens[{i}]", minimum=0), check_int(r, name=f"group_rows[{i}]"))
            for i, (p, r) in enumerate(zip(prefix_tokens, group_rows))]


def prefix_reads(group_rows: int, geometry: ModelGeometry) -> int:
    """How many times the shared read reads a group's prefix: once per tile of its rows."""
    return -(-group_rows // prefix_tile_rows(geometry))


def kv_bytes_read(
    context_tokens: int, geometry: ModelGeometry, *, prefix_tokens: int | Sequence[int] = (),
    group_rows: int | Sequence[int] = (),
) -> int:
    """KV bytes one decode step's attention reads over all layers (keys and values).

    ``context_tokens`` is the tokens every row attends to, summed over the step's rows (each row's
    position + 1). Without groups it is the plain read; with ``prefix_tokens`` and ``group_rows``
    (per group: its shared prefix tokens, held by each of its rows, and its rows) the shared read,
    which reads each group's prefix ``prefix_reads`` times instead of once per row. ValueError when
    the groups' prefixes are more tokens than ``context_tokens``.
    """
    if not isinstance(geometry, ModelGeometry):
        raise ValueError(f"geometry must be a ModelGeometry, got {geometry!r}")
    context_tokens = check_int(context_tokens, name="context_tokens", minimum=0)
    groups = _groups(prefix_tokens, group_rows) if prefix_tokens != () or group_rows != () else []
    held = sum(prefix * rows for prefix, rows in groups)
    if held > context_tokens:
        raise ValueError(f"the groups' rows hold {held} prefix tokens, more than context_tokens={context_tokens} "
                         "(each row's position + 1, summed): give each row's whole context")
    read = context_tokens - held + sum(prefix * prefix_reads(rows, geometry) for prefix, rows in groups)
    return read * geometry.kv_bytes_per_token


def shared_read_saving_bytes(
    prefix_tokens: int | Sequence[int], group_rows: int | Sequence[int], geometry: ModelGeometry, *,
    prefix_splits: int, ungrouped_rows: int = 0, launch_cost_bytes: float = LAUNCH_COST_BYTES,
) -> float:
    """The bytes a decode step saves by the shared read over the plain one (negative: it costs):
    the prefix reads it spares, less its prefix partials (written and read back, ``prefix_splits``
    per row, query head and layer: ``engine.kernels.shared_prefix.prefix_splits`` on the device) and
    its ``EXTRA_LAUNCHES`` per layer at ``launch_cost_bytes`` each."""
    if not isinstance(geometry, ModelGeometry):
        raise ValueError(f"geometry must be a ModelGeometry, got {geometry!r}")
    groups = _groups(prefix_tokens, group_rows)
    prefix_splits = check_int(prefix_splits, name="prefix_splits")
    ungrouped_rows = check_int(ungrouped_rows, name="ungrouped_rows", minimum=0)
    if isinstance(launch_cost_bytes, bool) or not isinstance(launch_cost_bytes, (int, float)) \
            or not 0 <= launch_cost_bytes < float("inf"):
        raise ValueError(f"launch_cost_bytes must be a finite number >= 0, got {launch_cost_bytes!r}")
    g = geometry
    spared = sum(prefix * (rows - prefix_reads(rows, g)) for prefix, rows in groups if prefix)
    partial = 2 * PARTIAL_BYTES * (g.head_dim + 2) * g.num_query_heads * g.num_layers * prefix_splits
    partials = (sum(rows for _, rows in groups) + ungrouped_rows) * partial
    return spared * g.kv_bytes_per_token - partials - EXTRA_LAUNCHES * g.num_layers * launch_cost_bytes


def shared_prefix_pays(
    prefix_tokens: int | Sequence[int], group_rows: int | Sequence[int], geometry: ModelGeometry, *,
    prefix_splits: int, ungrouped_rows: int = 0, launch_cost_bytes: float = LAUNCH_COST_BYTES,
) -> bool:
    """Whether a decode step should read its groups' shared prefixes once per group (``"auto"``):
    ``shared_read_saving_bytes`` > 0."""
    return shared_read_saving_bytes(prefix_tokens, group_rows, geometry, prefix_splits=prefix_splits,
                                    ungrouped_rows=ungrouped_rows, launch_cost_bytes=launch_cost_bytes) > 0
