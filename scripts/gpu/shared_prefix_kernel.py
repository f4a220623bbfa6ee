"""The shared-prefix decode read (engine.kernels.shared_prefix) against the plain paged read, on the
issue's shape: Qwen2.5-3B heads (16 query, 2 KV, head_dim 128), blocks of 64, 32 groups x 16 rows
whose prompts of 2,000 tokens share 31 full blocks, each row 1..512 tokens past its prompt.

    python scripts/gpu/shared_prefix_kernel.py --out $OUT/shared_prefix_kernel.json    # a GPU
    TINY=1 python scripts/gpu/shared_prefix_kernel.py --out /tmp/shared_prefix.json      # a CPU check

Three reads of one layer, for each spread of the rows' suffixes: ``copies`` (today's paged route:
each row holds its own copy of the prompt, read by ``paged_attention``), ``shared blocks`` (the rows'
tables point at the group's blocks, still read once per row by ``paged_attention``) and ``shared
read`` (``shared_prefix_attention``: the prefix once per group). A CUDA graph of ``--layers`` calls
is replayed ``--iters`` times (the decode step's launches, back to back) and timed by CUDA events;
each read's GB/s is the KV bytes it moves (``planner.kv_reads.kv_bytes_read``) over its time, and
``effective`` the plain read's bytes over it. ``no prefix`` times the shared read with every row
ungrouped against the plain one: the price of its extra launches, which the record gives as
``launch_cost_bytes`` (the time difference at the plain read's bandwidth, less the partials' bytes,
per extra launch;
``planner.kv_reads.LAUNCH_COST_BYTES`` is its default). ``TINY=1`` runs small shapes under
``TRITON_INTERPRET=1`` on the CPU, one call each, to check the script. The record (JSON, with
provenance) goes to ``--out``.
"""
from __future__ import annotations

import os

if os.environ.get("TINY") == "1":  # set before Triton is imported: the kernels read it when defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from rollout_lab.engine.kernels.paged import paged_attention, paged_splits  # noqa: E402
from rollout_lab.engine.kernels import shared_prefix  # noqa: E402
from rollout_lab.engine.kernels.shared_prefix import prefix_splits, shared_prefix_attention  # noqa: E402
from rollout_lab.measure.provenance import provenance  # noqa: E402
from rollout_lab.planner.cost import ModelGeometry  # noqa: E402
from rollout_lab.planner.kv_reads import EXTRA_LAUNCHES, kv_bytes_read, shared_read_saving_bytes  # noqa: E402
from rollout_lab.workspace import write_json_atomic  # noqa: E402


def make_case(*, groups: int, group_rows: int, prompt: int, suffixes: torch.Tensor, heads: int, kv_heads: int,
              head_dim: int, block_size: int, dtype: torch.dtype, device: str, seed: int = 0) -> dict:
    """One pool holding each group's shared prompt blocks, every row's copy of them, and every row's
    own blocks (its prompt's partial block and its suffix), in a shuffled order; the tables of the
    copies and of the shared blocks, positions, groups and the query."""
    gen = torch.Generator().manual_seed(seed)
    rows = groups * group_rows
    shared = prompt // block_size  # full blocks of the prompt
    contexts = prompt + suffixes  # [rows] tokens each row attends to
    own = -(-contexts // block_size) - shared  # [rows] blocks past the shared ones
    max_blocks = int((shared + own).max())
    total = 1 + groups * shared + rows * shared + int(own.sum())
    order = (torch.randperm(total - 1, generator=gen) + 1).to(torch.int32)
    take = iter(order.tolist())
    prefix_blocks = torch.tensor([[next(take) for _ in range(shared)] for _ in range(groups)], dtype=torch.int32)
    copies = torch.zeros(rows, max_blocks, dtype=torch.int32)
    tables = torch.zeros(rows, max_blocks, dtype=torch.int32)
    shape = (total, block_size, kv_heads, head_dim)
    key = torch.randn(shape, generator=gen).to(dtype)
    value = torch.randn(shape, generator=gen).to(dtype)
    for row in range(rows):
        group = row // group_rows
        copies[row, :shared] = torch.tensor([next(take) for _ in range(shared)], dtype=torch.int32)
        key[copies[row, :shared].long()] = key[prefix_blocks[group].long()]  # the prompt's copy
        value[copies[row, :shared].long()] = value[prefix_blocks[group].long()]
        mine = torch.tensor([next(take) for _ in range(int(own[row]))], dtype=torch.int32)
        copies[row, shared: shared + len(mine)] = mine
        tables[row, :shared] = prefix_blocks[group]
        tables[row, shared: shared + len(mine)] = mine
    put = lambda t: t.to(device)  # noqa: E731
    return dict(
        query=put(torch.randn(rows, heads, 1, head_dim, generator=gen).to(dtype)), key=put(key), value=put(value),
        copies=put(copies), tables=put(tables), positions=put((contexts - 1).to(torch.long)),
        group_of_row=put(torch.arange(rows, dtype=torch.int32) // group_rows), prefix_blocks=put(prefix_blocks),
        prefix_len=put(torch.full((groups,), shared * block_size, dtype=torch.int32)),
        no_groups=put(torch.full((rows,), -1, dtype=torch.int32)), contexts=contexts, shared_tokens=shared * block_size,
    )


def timed_ms(fn, *, layers: int, iters: int, device: str) -> float:
    """Milliseconds per call of ``fn``: on CUDA a graph of ``layers`` calls replayed ``iters`` times."""
    if device != "cuda":
        started = time.perf_counter()
        for _ in range(max(1, iters)):
            fn()
        return (time.perf_counter() - started) * 1e3 / max(1, iters)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up outside the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(layers):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (iters * layers)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", default=os.environ.get("TINY") == "1",
                        help="small shapes, under TRITON_INTERPRET=1 on the CPU (TINY=1 sets both)")
    parser.add_argument("--iters", type=int, default=20, help="graph replays timed")
    parser.add_argument("--layers", type=int, default=36, help="calls per graph (Qwen2.5-3B's layers)")
    parser.add_argument("--prefix-splits", type=int, nargs="*", default=[],
                        help="also time the shared read at each of these level-1 split counts (the op's own "
                             "choice, engine.kernels.shared_prefix.prefix_splits, stands in for them one by one)")
    parser.add_argument("--out", type=Path, required=True, help="the JSON record")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.tiny:
        dtype, iters = torch.float32, 1
        shape = dict(groups=3, group_rows=4, prompt=40, heads=4, kv_heads=2, head_dim=16, block_size=16)
        spreads = {"U(1, 20)": (1, 20)}
    else:
        dtype, iters = torch.bfloat16, args.iters
        shape = dict(groups=32, group_rows=16, prompt=2_000, heads=16, kv_heads=2, head_dim=128, block_size=64)
        spreads = {"1 each": (1, 1), "U(1, 512)": (1, 512), "512 each": (512, 512)}
    rows = shape["groups"] * shape["group_rows"]
    geometry = ModelGeometry(1, shape["heads"], shape["kv_heads"], shape["head_dim"], torch.finfo(dtype).bits // 8)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    lines = [f"{name} {dtype}; heads {shape['heads']}/{shape['kv_heads']} head_dim {shape['head_dim']} block "
             f"{shape['block_size']}; {shape['groups']} groups x {shape['group_rows']} rows, prompt {shape['prompt']}; "
             f"per layer call, a graph of {args.layers} calls"]
    cases = []
    gen = torch.Generator().manual_seed(1)
    for spread, (low, high) in spreads.items():
        suffixes = torch.randint(low, high + 1, (rows,), generator=gen)
        case = make_case(suffixes=suffixes, dtype=dtype, device=device, **shape)
        q, k, v, pos = case["query"], case["key"], case["value"], case["positions"]
        scale = shape["head_dim"] ** -0.5
        groups = (case["group_of_row"], case["prefix_blocks"], case["prefix_len"])
        context = int(case["contexts"].sum())
        plain_bytes = kv_bytes_read(context, geometry)
        shared_bytes = kv_bytes_read(context, geometry, prefix_tokens=[case["shared_tokens"]] * shape["groups"],
                                     group_rows=[shape["group_rows"]] * shape["groups"])
        reads = {
            "copies": (lambda: paged_attention(q, k, v, case["copies"], pos, scale), plain_bytes),
            "shared blocks": (lambda: paged_attention(q, k, v, case["tables"], pos, scale), plain_bytes),
            "shared read": (lambda: shared_prefix_attention(q, k, v, case["tables"], pos, *groups, scale),
                            shared_bytes),
            "no prefix": (lambda: shared_prefix_attention(q, k, v, case["copies"], pos, case["no_groups"],
                                                          *groups[1:], scale), plain_bytes),
        }
        want = reads["copies"][0]().float()
        times = {}
        record = {"spread": spread, "context_tokens": context, "plain_bytes": plain_bytes,
                  "shared_bytes": shared_bytes, "reads": {}, "splits": {
                      "plain": paged_splits(rows, shape["kv_heads"], case["copies"].shape[1], device),
                      "prefix": prefix_splits(shape["groups"], shape["kv_heads"], case["prefix_blocks"].shape[1],
                                              device)}}
        lines.append(f"\nsuffixes {spread}: {context:,} context tokens, plain {plain_bytes / 2**20:.0f} MiB, "
                     f"shared {shared_bytes / 2**20:.0f} MiB per call; splits {record['splits']}")
        for read, (fn, nbytes) in reads.items():
            diff = float((fn().float() - want).abs().max())
            ms = timed_ms(fn, layers=args.layers, iters=iters, device=device)
            times[read] = ms
            record["reads"][read] = {"ms": ms, "bytes": nbytes, "gb_per_s": nbytes / ms / 1e6,
                                     "effective_gb_per_s": plain_bytes / ms / 1e6, "max_abs_diff": diff}
            lines.append(f"  {read:14} {ms * 1e3:9.1f} us  {nbytes / ms / 1e6:7.0f} GB/s  effective "
                         f"{plain_bytes / ms / 1e6:7.0f} GB/s  max |diff| {diff:.2e}")
        chosen = shared_prefix.prefix_splits
        record["prefix_split_sweep"] = {}
        for count in args.prefix_splits:
            shared_prefix.prefix_splits = lambda *_, count=count: count  # noqa: E731  (the op looks it up per call)
            try:
                ms = timed_ms(reads["shared read"][0], layers=args.layers, iters=iters, device=device)
            finally:
                shared_prefix.prefix_splits = chosen
            record["prefix_split_sweep"][count] = ms
            lines.append(f"  shared read at {count:2} prefix splits {ms * 1e3:9.1f} us  effective "
                         f"{plain_bytes / ms / 1e6:7.0f} GB/s")
        record["speedup_over_copies"] = times["copies"] / times["shared read"]
        record["speedup_over_shared_blocks"] = times["shared blocks"] / times["shared read"]
        # the extra time at the plain read's bandwidth, less the partials the formula prices apart
        partials = -shared_read_saving_bytes([], [], geometry, prefix_splits=record["splits"]["prefix"],
                                             ungrouped_rows=rows, launch_cost_bytes=0)
        extra = (times["no prefix"] - times["copies"]) * plain_bytes / times["copies"]
        record["launch_cost_bytes"] = max(0.0, extra - partials) / EXTRA_LAUNCHES
        lines.append(f"  shared read / copies: {record['speedup_over_copies']:.2f}x; / shared blocks: "
                     f"{record['speedup_over_shared_blocks']:.2f}x; an extra launch ~ "
                     f"{record['launch_cost_bytes'] / 2**20:.1f} MiB of the plain read")
        cases.append(record)
    print("\n".join(lines))
    write_json_atomic(args.out, {
        "kind": "shared_prefix_kernel", "shape": shape, "dtype": str(dtype).replace("torch.", ""),
        "layers_per_graph": args.layers, "iters": iters, "cases": cases,
        "provenance": provenance(device=device, dtype=dtype),
    })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
