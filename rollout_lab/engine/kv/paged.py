"""The paged KV cache of the ``paged`` route: fixed-size blocks, a block table per row.

One key and one value pool per layer, ``[num_blocks, block_size, kv_heads, head_dim]``, allocated
once. Row (slot) ``i`` holds its tokens at logical positions ``0, 1, ...`` (its own RoPE positions:
a prompt at ``[0, len)``, then one token per decode step), and logical position ``p`` lives at
``pool[block_tables[i, p // block_size], p % block_size]``. A row is admitted as soon as a slot and
the blocks of its prompt are free, grows one block at a time, and gives its blocks back when it
retires: the memory follows the live tokens, not slots x the longest row. Rows never write into a
shared block: the samples of a prompt admitted together read its full blocks (``share``: reference
counts, no copy), and each holds its own copy of the prompt's partial last block
(``copy_positions``) and its own blocks for its tokens, so a sample's first decode token lands in a
block of its own. Block 0 is a scratch block: a dead slot's table points at it, so a graph replay
that still covers dead slots writes there and nowhere else.

With ``kv_dtype="fp8"`` (``RolloutConfig(kv_cache_dtype="fp8")``) each pool is
``engine.kernels.kv_fp8``'s uint8 layout: e4m3 values and a scale per (token, KV head). Everything that
reads or writes tokens on the host side (admission, copies, gathers) goes through ``_read``/``_write``,
which dequantize and quantize; the decode step's write and the attention do it in their kernels.

The prefix cache across calls (``RolloutConfig.prefix_cache``): a prompt's full blocks, once written,
are keyed by a hash chain of their tokens (``block_keys``: block i's key hashes block i-1's key and
its token ids, vLLM's scheme) and stay in the pool after their last reader leaves, idle, least
recently used first. An idle cached block counts as free: ``grow`` takes one back (its key dropped)
only when the free list runs dry, so the cache never costs a row a block. A later prompt reads the
longest chain of its blocks found (``match``, then ``attach``: reference counts, no copy) and is
prefilled past them; the pool keeps them across calls (``reset`` keeps them, ``clear_cached``
drops them: the weights changed).

The host owns the allocation (``BlockAllocator``: a free list, each slot's blocks, each block's
readers); the device holds
what a decode step reads: ``block_tables`` ``[slots, max_blocks]`` int32 and ``slot_mapping``
``[slots]`` int64, the flat pool index each row writes this step. Every decode step computes
``slot_mapping`` from the rows' positions in place (``prepare_step``), so the step captures in a
CUDA graph and replays while rows move through their blocks. ``hf_cache(num_rows)`` gives the
transformers ``Cache`` whose layers write one token per row there and hand the whole pool to the
attention (``engine.kernels.paged``, selected by the ``paged_tables``/``paged_positions`` keywords
the decode step passes).

Admission copies a prefill's KV into a row's blocks (``admit``: a left-padded bucket; ``admit_packed``:
a packed forward), with the same arguments as the aligned cache's methods, so the batcher prefills
either cache the same way.

    cache = PagedKVCache.for_model(model, num_slots=128, num_blocks=4096, block_size=64, max_blocks_per_row=40)
    cache.grow(slot, num_tokens)             # blocks for a row's first num_tokens positions
    cache.share(sample, slot, num_tokens)    # another sample reads the prompt's full blocks
    cache.attach(slot, cache.allocator.match(block_keys(prompt, 64)))  # a prompt's cached blocks

"""
from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict
from typing import Sequence

import torch
from transformers.cache_utils import Cache, StaticLayer

from rollout_lab.engine.kernels import kv_fp8
from rollout_lab.engine.kernels.available import kernel_available, tl, triton
from rollout_lab.engine.kv.aligned import device_tensor
from rollout_lab.planner.checks import check_int
from rollout_lab.planner.cost import ModelGeometry
from rollout_lab.planner.occupancy import blocks_for

SCRATCH_BLOCK = 0  # dead slots point here; never handed to a row
# what the pools store: "auto" the model's dtype, "fp8" e4m3 with a scale per token and KV head
# (engine.kernels.kv_fp8: half the bytes a decode step reads, lossy)
KV_DTYPES = ("auto", "fp8")


def block_keys(tokens: Sequence[int], block_size: int) -> list[bytes]:
    """The prefix-cache key of each full block of ``tokens``: block i's is the SHA-256 of block
    i-1's key and its token ids, so two prompts' i-th keys are equal exactly when their first
    ``(i + 1) * block_size`` tokens are (a collision aside)."""
    keys, key = [], b""
    for start in range(0, len(tokens) - block_size + 1, block_size):
        key = hashlib.sha256(key + array("q", tokens[start : start + block_size]).tobytes()).digest()
        keys.append(key)
    return keys


class BlockAllocator:
    """Host bookkeeping of the pool: the free blocks, each slot's blocks in logical order, and each
    block's readers (reference counts: a prompt's full blocks sit in the lists of the samples
    admitted with it, ``share``). A block goes back to the free list when its last reader releases
    it, or, keyed in the prefix cache (``register``), to the idle cached blocks, which count as free
    and are taken back, least recently used first, when the free list runs dry."""

    def __init__(self, num_blocks: int, num_slots: int, block_size: int, max_blocks_per_row: int):
        self.num_blocks, self.block_size, self.max_blocks_per_row = num_blocks, block_size, max_blocks_per_row
        self.free = list(range(num_blocks - 1, SCRATCH_BLOCK, -1))  # pop() hands out 1, 2, ...
        self.blocks: list[list[int]] = [[] for _ in range(num_slots)]
        self.refs = [0] * num_blocks  # readers of each block (slots whose list holds it)
        self.num_shared = 0  # blocks with more than one reader
        self.extra_refs = 0  # readers past the first, summed over the blocks: the duplicate blocks copies would take
        self.peak_used = 0
        self.peak_shared = 0
        self.cached: dict[bytes, int] = {}  # prefix-cache key -> block
        self.key_of: dict[int, bytes] = {}  # block -> its key (cached blocks only)
        self.idle: OrderedDict[int, None] = OrderedDict()  # cached blocks no row reads, least recently used first
        self.num_evicted = 0  # idle cached blocks taken back since the last reset
        # bumped whenever a slot's shared blocks may change (share, attach, release, move, reset): the
        # groups of rows reading the same prefix (``prefix_groups``) are found again only then
        self.version = 0

    @property
    def num_free(self) -> int:
        return len(self.free) + len(self.idle)

    @property
    def num_cached(self) -> int:
        return len(self.cached)

    @property
    def num_used(self) -> int:
        """Blocks rows read (an idle cached block is free)."""
        return self.num_blocks - 1 - self.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    def missing(self, slot: int, num_tokens: int) -> int:
        """Blocks ``slot`` still needs to hold positions ``[0, num_tokens)``."""
        return max(0, self.blocks_for(num_tokens) - len(self.blocks[slot]))

    def grow(self, slot: int, num_tokens: int) -> list[tuple[int, int]]:
        """Give ``slot`` the blocks for positions ``[0, num_tokens)``; returns the new
        (logical index, block) pairs for the device table. The caller checked ``num_free``."""
        need = self.missing(slot, num_tokens)
        if need > self.num_free:
            raise RuntimeError(f"slot {slot} needs {need} blocks, {self.num_free} are free")
        self._check_width(slot, need)
        added = []
        for _ in range(need):
            block = self._take()
            self.refs[block] = 1
            added.append((len(self.blocks[slot]), block))
            self.blocks[slot].append(block)
        self.peak_used = max(self.peak_used, self.num_used)
        return added

    def _take(self) -> int:
        """A free block, else the least recently used idle cached block (its key dropped)."""
        if self.free:
            return self.free.pop()
        block, _ = self.idle.popitem(last=False)
        del self.cached[self.key_of.pop(block)]
        self.num_evicted += 1
        return block

    def match(self, keys: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of ``keys`` (``block_keys``) in the cache."""
        blocks = []
        for key in keys:
            block = self.cached.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def attach(self, slot: int, blocks: Sequence[int]) -> list[tuple[int, int]]:
        """``slot`` (holding none) reads the cached ``blocks`` (``match``) as its first ones: each gains
        a reader (an idle one leaves the idle list); returns the (logical index, block) pairs."""
        if self.blocks[slot]:
            raise RuntimeError(f"slot {slot} still holds blocks")
        self._check_width(slot, len(blocks))
        for block in blocks:
            if block not in self.key_of:
                raise RuntimeError(f"block {block} is not in the prefix cache")
            self.refs[block] += 1
            if self.refs[block] == 1:
                del self.idle[block]
            else:
                self.extra_refs += 1
                self.num_shared += self.refs[block] == 2
        self.version += 1
        self.blocks[slot] = list(blocks)
        self.peak_used = max(self.peak_used, self.num_used)
        self.peak_shared = max(self.peak_shared, self.num_shared)
        return list(enumerate(blocks))

    def register(self, slot: int, keys: Sequence[bytes]) -> None:
        """Key the first ``len(keys)`` blocks of ``slot`` (a prompt's full blocks, written) in the
        prefix cache; a block keyed already, or a key another block holds, is left as it is."""
        for block, key in zip(self.blocks[slot], keys):
            if block not in self.key_of and key not in self.cached:
                self.cached[key] = block
                self.key_of[block] = key

    def clear_cached(self) -> int:
        """Drop every key of the prefix cache (the idle blocks become free; a block a row still reads
        is freed when it leaves); the number of blocks dropped."""
        dropped = len(self.cached)
        self.free.extend(reversed(self.idle))
        self.idle.clear()
        self.cached.clear()
        self.key_of.clear()
        return dropped

    def share(self, slot: int, source: int, num_blocks: int) -> list[tuple[int, int]]:
        """``slot`` (holding none) reads the first ``num_blocks`` blocks of ``source``: they gain a
        reader each, no block is taken; returns the (logical index, block) pairs for the device table.
        Only full blocks are shared: ``slot`` writes its own tokens past them, in blocks of its own."""
        if self.blocks[slot]:
            raise RuntimeError(f"slot {slot} still holds blocks")
        if num_blocks > len(self.blocks[source]):
            raise RuntimeError(f"slot {source} holds {len(self.blocks[source])} blocks, fewer than the "
                               f"{num_blocks} slot {slot} would share")
        self._check_width(slot, num_blocks)
        shared = self.blocks[source][:num_blocks]
        for block in shared:
            self.refs[block] += 1
            self.extra_refs += 1
            self.num_shared += self.refs[block] == 2
        self.version += 1
        self.blocks[slot] = list(shared)
        self.peak_shared = max(self.peak_shared, self.num_shared)
        return list(enumerate(shared))

    def _check_width(self, slot: int, more: int) -> None:
        if len(self.blocks[slot]) + more > self.max_blocks_per_row:
            raise RuntimeError(f"slot {slot} would hold {len(self.blocks[slot]) + more} blocks, "
                               f"more than the table's {self.max_blocks_per_row}")

    def release(self, slot: int) -> None:
        """The slot drops its blocks (its row retired or was preempted); those it was the last
        reader of go back to the free list, or the cached ones to the idle list (its last block
        first, so a prompt's later blocks are taken back before its earlier ones)."""
        for block in reversed(self.blocks[slot]):
            self.refs[block] -= 1
            if self.refs[block]:
                self.extra_refs -= 1
                self.num_shared -= self.refs[block] == 1
            elif block in self.key_of:
                self.idle[block] = None
            else:
                self.free.append(block)
        self.version += 1
        self.blocks[slot] = []

    def move(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Slots ``dst`` take over the blocks of ``src`` (compaction; their readers move with them);
        ``src`` hold none after."""
        self.version += 1
        taken = [self.blocks[s] for s in src]
        for s in src:
            self.blocks[s] = []
        for d, blocks in zip(dst, taken):
            if self.blocks[d]:
                raise RuntimeError(f"slot {d} still holds blocks")
            self.blocks[d] = blocks

    def prefix_groups(self, num_rows: int, max_groups: int) -> tuple[list[int], list[list[int]]]:
        """The rows among slots ``[0, num_rows)`` that read the same leading blocks, grouped for the
        shared-prefix decode read (``engine.kernels.shared_prefix``): each row's group (-1: none) and
        each group's shared blocks, at most ``max_groups`` groups of two rows or more (rows past them
        read as ungrouped). A shared block is a full prompt block that ``share`` or ``attach`` put at
        the same logical index of every reader's list, so rows whose first blocks are one block share
        the common start of their lists, and where two lists hold one block at index i they agree
        before it."""
        lead: dict[int, int] = {}  # first block -> group
        heads: list[int] = []  # group -> its first row
        shared: list[int] = []  # group -> blocks its rows have in common so far
        members: list[int] = []
        group_of_row = [-1] * num_rows
        for slot in range(num_rows):
            blocks = self.blocks[slot]
            if not blocks or self.refs[blocks[0]] < 2:
                continue
            group = lead.get(blocks[0])
            if group is None:
                if len(heads) == max_groups:
                    continue
                group = lead[blocks[0]] = len(heads)
                heads.append(slot)
                shared.append(len(blocks))
                members.append(0)
            else:
                head, n = self.blocks[heads[group]], min(shared[group], len(blocks))
                while blocks[n - 1] != head[n - 1]:
                    n -= 1
                shared[group] = n
            members[group] += 1
            group_of_row[slot] = group
        keep = [g for g in range(len(heads)) if members[g] > 1]  # a lone reader (its sharers retired) reads plainly
        renumber = {g: i for i, g in enumerate(keep)}
        group_of_row = [renumber.get(g, -1) for g in group_of_row]
        return group_of_row, [self.blocks[heads[g]][: shared[g]] for g in keep]

    def reset(self) -> None:
        """Every slot holds none again; the prefix cache stays (its blocks idle)."""
        for block in self.key_of:
            if self.refs[block]:
                self.idle[block] = None
        self.free = [b for b in range(self.num_blocks - 1, SCRATCH_BLOCK, -1) if b not in self.key_of]
        self.blocks = [[] for _ in self.blocks]
        self.refs = [0] * self.num_blocks
        self.num_shared = self.extra_refs = 0
        self.peak_used = self.peak_shared = 0
        self.num_evicted = 0
        self.version += 1


@torch.library.custom_op("rollout_lab::paged_write", mutates_args=("key_pool", "value_pool"))
def paged_write(key_pool: torch.Tensor, value_pool: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                slot_mapping: torch.Tensor) -> None:
    """Write each row's token (``keys``/``values`` ``[rows, kv_heads, head_dim]``) into the pools
    (``[num_blocks, block_size, kv_heads, head_dim]``) at its flat index ``slot_mapping[row]``.

    An op of its own, declared to mutate the pools: traced by ``torch.compile`` as an in-place
    ``index_copy_`` on a view of the pool, the write is functionalised into a copy of the whole pool
    per layer and step; as an opaque mutating op it writes the rows' tokens only. Where the Triton
    kernels run (``kernels.available.kernel_available``) one launch writes both pools
    (``_paged_write_kernel``: a program per row) instead of two ``index_copy_`` launches per layer and
    step, each launch costing about what its copy does."""
    rows = keys.shape[0]
    width = keys.shape[1] * keys.shape[2]  # one token's kv_heads x head_dim
    same = keys.dtype == values.dtype == key_pool.dtype == value_pool.dtype  # a copy, no rounding
    if rows and same and kernel_available(keys.device) and key_pool.is_contiguous() and value_pool.is_contiguous() \
            and keys.stride(2) == 1 and values.stride(2) == 1:
        _paged_write_kernel[(rows,)](
            key_pool, value_pool, keys, values, slot_mapping, keys.stride(0), keys.stride(1),
            values.stride(0), values.stride(1), HEADS=keys.shape[1], HEAD_DIM=keys.shape[2],
            BLOCK=triton.next_power_of_2(width), num_warps=4)
        return
    for pool, new in ((key_pool, keys), (value_pool, values)):
        pool.view(-1, pool.shape[2], pool.shape[3]).index_copy_(0, slot_mapping, new.to(pool.dtype))


if triton is not None:

    @triton.jit
    def _paged_write_kernel(KeyPool, ValuePool, Keys, Values, SlotMapping, stride_kr, stride_kh, stride_vr,
                            stride_vh, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
        """Row ``r``'s key and value (``[HEADS, HEAD_DIM]``, last dimension contiguous, the pools'
        dtype) into the flat token ``slot_mapping[r]`` of each pool."""
        row = tl.program_id(0)
        i = tl.arange(0, BLOCK)
        live = i < HEADS * HEAD_DIM
        head, dim = i // HEAD_DIM, i % HEAD_DIM
        slot = tl.load(SlotMapping + row).to(tl.int64)
        key = tl.load(Keys + row * stride_kr + head * stride_kh + dim, mask=live)
        value = tl.load(Values + row * stride_vr + head * stride_vh + dim, mask=live)
        tl.store(KeyPool + slot * HEADS * HEAD_DIM + i, key, mask=live)
        tl.store(ValuePool + slot * HEADS * HEAD_DIM + i, value, mask=live)


class PagedLayer(StaticLayer):
    """A cache layer over one layer's pools: writes each row's decode token at its slot mapping and
    gives the attention the whole pool (it reads each row's blocks through the table). FP8 pools
    (uint8, ``engine.kernels.kv_fp8``) are written quantized; ``dtype`` is then the model's."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor, dtype: torch.dtype):
        self.fp8 = kv_fp8.is_fp8_pool(keys)
        block_size = kv_fp8.split(keys)[0].shape[1] if self.fp8 else keys.shape[1]
        super().__init__(max_cache_len=keys.shape[0] * block_size)
        self.keys, self.values = keys, values  # [num_blocks, block_size, kv_heads, head_dim] (FP8: kv_fp8's rows)
        self.slot_mapping = slot_mapping  # [rows] flat pool index of each row's token this step
        self.device, self.dtype = keys.device, dtype
        self.num_heads = keys.shape[2]
        self.k_head_dim = self.v_head_dim = keys.shape[-1]
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise RuntimeError("PagedLayer is preallocated")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if key_states.shape[-2] != 1:
            raise RuntimeError(f"the paged cache takes one decode token per row, got {key_states.shape[-2]}; "
                               "prefill goes through a temporary cache")
        write = kv_fp8.paged_write_fp8 if self.fp8 else paged_write
        write(self.keys, self.values, key_states[:, :, 0], value_states[:, :, 0],  # [rows, kv_heads, head_dim]
              self.slot_mapping)
        return self.keys, self.values

    def get_seq_length(self):
        return 0

    def crop(self, tokens_to_remove: int) -> None:
        raise RuntimeError("the paged cache frees blocks, it is never cropped")


class PagedKVCache:
    """Per-layer block pools, the device block tables and slot mapping, and the host allocator."""

    def __init__(
        self, *, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int, block_size: int,
        num_blocks: int, max_blocks_per_row: int, dtype: torch.dtype, device: torch.device | str,
        prefix_groups: int = 0, kv_dtype: str = "auto",
    ):
        if num_slots < 1 or max_blocks_per_row < 1:
            raise ValueError(f"num_slots and max_blocks_per_row must be >= 1, got {num_slots}, {max_blocks_per_row}")
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is scratch), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {list(KV_DTYPES)}, got {kv_dtype!r}")
        self.kv_dtype, self.dtype = kv_dtype, dtype  # the pools' storage; the model's dtype, which reads give
        self.fp8 = kv_dtype == "fp8"
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        shape = (num_blocks, block_size, num_kv_heads, head_dim)

        def pool() -> torch.Tensor:  # FP8: e4m3 rows and their scale rows (engine.kernels.kv_fp8)
            return kv_fp8.allocate(*shape, device) if self.fp8 else torch.zeros(shape, dtype=dtype, device=device)

        self.keys = [pool() for _ in range(num_layers)]
        self.values = [pool() for _ in range(num_layers)]
        self.num_bytes = sum(p.numel() * p.element_size() for p in (*self.keys, *self.values))  # the pools, fixed
        self.block_tables = torch.full((num_slots, max_blocks_per_row), SCRATCH_BLOCK, dtype=torch.int32,
                                       device=device)  # [slots, max_blocks]
        self.slot_mapping = torch.zeros(num_slots, dtype=torch.long, device=device)  # [slots]
        self.mask = torch.zeros(num_slots, 1, 1, 1, dtype=dtype, device=device)  # a 4-D mask HF passes through
        self.num_slots, self.block_size, self.num_blocks = num_slots, block_size, num_blocks
        self.max_blocks_per_row = max_blocks_per_row
        self.capacity = max_blocks_per_row * block_size  # tokens one row can hold
        self.allocator = BlockAllocator(num_blocks, num_slots, block_size, max_blocks_per_row)
        self._views: dict[int, Cache] = {}
        # the shared-prefix read (``prefix_groups`` > 0, ``engine.kernels.shared_prefix``): each row's group
        # (-1: none), each group's shared blocks and their tokens, found on the host when the rows'
        # blocks changed (``refresh_prefix_groups``) and read by the decode step on the device
        self.prefix_groups = check_int(prefix_groups, name="prefix_groups", minimum=0)
        self.group_of_row = torch.full((num_slots,), -1, dtype=torch.int32, device=device)  # [slots]
        self.prefix_blocks = torch.zeros(max(1, prefix_groups), max_blocks_per_row, dtype=torch.int32,
                                         device=device)  # [groups, max_blocks]
        self.prefix_len = torch.zeros(max(1, prefix_groups), dtype=torch.int32, device=device)  # [groups]
        self.group_rows: list[int] = []  # rows of each group as last refreshed
        self.group_tokens: list[int] = []  # shared tokens of each group as last refreshed
        self._groups_seen: tuple[int, int] | None = None  # (allocator version, rows) of the last refresh

    @classmethod
    def for_model(cls, model: torch.nn.Module, *, num_slots: int, num_blocks: int, block_size: int,
                  max_blocks_per_row: int, prefix_groups: int = 0, kv_dtype: str = "auto") -> "PagedKVCache":
        param = next(model.parameters())
        geometry = ModelGeometry.from_config(model.config.get_text_config(decoder=True), param.dtype)
        return cls(num_layers=geometry.num_layers, num_slots=num_slots, num_kv_heads=geometry.num_kv_heads,
                   head_dim=geometry.head_dim, block_size=block_size, num_blocks=num_blocks,
                   max_blocks_per_row=max_blocks_per_row, dtype=param.dtype, device=param.device,
                   prefix_groups=prefix_groups, kv_dtype=kv_dtype)

    # -- sizes ------------------------------------------------------------------------------
    @property
    def token_bytes(self) -> float:
        """Bytes of one token's KV over all layers, keys and values (FP8: its share of the scales too)."""
        return self.num_bytes / (self.num_blocks * self.block_size)

    def hf_cache(self, num_rows: int) -> Cache:
        """A transformers Cache whose layers write the first ``num_rows`` slots' tokens; memoised."""
        if num_rows not in self._views:
            mapping = self.slot_mapping[:num_rows]
            self._views[num_rows] = Cache(layers=[PagedLayer(k, v, mapping, self.dtype)
                                                  for k, v in zip(self.keys, self.values)])
        return self._views[num_rows]

    # -- the step -----------------------------------------------------------------------------
    def prepare_step(self, num_rows: int, positions: torch.Tensor) -> None:
        """``slot_mapping`` of the first ``num_rows`` slots for a token at ``positions`` [rows] (in
        place, on the device: graph-capturable)."""
        tables = self.block_tables[:num_rows]  # [rows, max_blocks]
        block = tables.gather(1, torch.div(positions, self.block_size, rounding_mode="floor")[:, None])[:, 0]
        self.slot_mapping[:num_rows].copy_(block.long() * self.block_size + positions % self.block_size)

    def refresh_prefix_groups(self, num_rows: int) -> None:
        """Before a decode step over the first ``num_rows`` slots with the shared-prefix read: the groups
        of rows reading the same leading blocks (``BlockAllocator.prefix_groups``) into the device
        buffers the step reads; found again only when the rows' blocks changed since the last time."""
        seen = (self.allocator.version, num_rows)
        if not self.prefix_groups or seen == self._groups_seen:
            return
        group_of_row, blocks = self.allocator.prefix_groups(num_rows, self.prefix_groups)
        rows = torch.full((self.num_slots,), -1, dtype=torch.int32)
        rows[:num_rows] = torch.tensor(group_of_row, dtype=torch.int32)
        table = torch.zeros(self.prefix_blocks.shape, dtype=torch.int32)
        for group, shared in enumerate(blocks):
            table[group, : len(shared)] = torch.tensor(shared, dtype=torch.int32)
        tokens = [len(shared) * self.block_size for shared in blocks]
        lengths = torch.zeros(self.prefix_len.shape, dtype=torch.int32)
        lengths[: len(tokens)] = torch.tensor(tokens, dtype=torch.int32)
        for buf, host in ((self.group_of_row, rows), (self.prefix_blocks, table), (self.prefix_len, lengths)):
            buf.copy_(host)  # one host-to-device copy each
        sizes = Counter(group_of_row)
        self.group_rows = [sizes[g] for g in range(len(blocks))]
        self.group_tokens = tokens
        self._groups_seen = seen

    # -- the tables -----------------------------------------------------------------------------
    def grow(self, slot: int, num_tokens: int) -> None:
        """Blocks for positions ``[0, num_tokens)`` of ``slot``, written into its device table."""
        self.set_blocks([(slot, index, block) for index, block in self.allocator.grow(slot, num_tokens)])

    def share(self, slot: int, source: int, num_tokens: int) -> None:
        """``slot`` (holding none) reads the full blocks of ``source``'s first ``num_tokens``
        positions (a prompt the samples share): table entries, no block taken, no KV copied. The
        rest of its positions go into blocks of its own (``grow``; ``copy_positions`` for the
        prompt's partial last block)."""
        entries = self.allocator.share(slot, source, num_tokens // self.block_size)
        self.set_blocks([(slot, index, block) for index, block in entries])

    def attach(self, slot: int, blocks: Sequence[int]) -> None:
        """``slot`` (holding none) reads the prefix cache's ``blocks`` (``BlockAllocator.match``) as
        its first ones: table entries, no block taken, no KV copied."""
        entries = self.allocator.attach(slot, blocks)
        self.set_blocks([(slot, index, block) for index, block in entries])

    def gather(self, blocks: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The KV of ``blocks``, in order, per layer ``[1, kv_heads, len(blocks) * block_size, head_dim]``
        (a copy: the prefix a prefill extends, ``sched.aligned.extend_prefill``)."""
        first = device_tensor(list(blocks), torch.long, self.block_tables.device) * self.block_size  # [blocks]
        index = (first[:, None] + torch.arange(self.block_size, device=first.device)).flatten()  # their tokens
        return [tuple(self._read(pool, index).transpose(0, 1)[None] for pool in pair)
                for pair in zip(self.keys, self.values)]

    def _read(self, pool: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """The tokens at flat pool positions ``index`` of one pool, [n, kv_heads, head_dim] in the
        model's dtype (an FP8 pool's dequantized)."""
        if not self.fp8:
            return pool.view(-1, self.num_kv_heads, self.head_dim).index_select(0, index)
        values, scales = kv_fp8.split(pool)
        block, row = index // self.block_size, index % self.block_size
        return kv_fp8.dequantize(values[block, row], scales[block, row], self.dtype)

    def _write(self, pool: torch.Tensor, index: torch.Tensor, tokens: torch.Tensor) -> None:
        """``tokens`` [n, kv_heads, head_dim] into flat pool positions ``index`` of one pool (an FP8
        pool's quantized: ``kv_fp8.quantize``, which gives a dequantized token back its own bits)."""
        if not self.fp8:
            pool.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, index, tokens.to(pool.dtype))
            return
        values, scales = kv_fp8.split(pool)
        block, row = index // self.block_size, index % self.block_size
        values[block, row], scales[block, row] = kv_fp8.quantize(tokens)

    def set_blocks(self, entries: Sequence[tuple[int, int, int]]) -> None:
        """Write (slot, logical index, block) entries into the device tables, one copy."""
        if not entries:
            return
        device = self.block_tables.device
        flat = device_tensor([s * self.max_blocks_per_row + i for s, i, _ in entries], torch.long, device)
        self.block_tables.view(-1).index_copy_(0, flat, device_tensor([b for _, _, b in entries], torch.int32, device))

    def reset(self) -> None:
        self.allocator.reset()
        self.block_tables.fill_(SCRATCH_BLOCK)
        self.slot_mapping.zero_()
        self.group_of_row.fill_(-1)
        self.prefix_len.zero_()
        self.group_rows, self.group_tokens, self._groups_seen = [], [], None

    def release(self, slots: Sequence[int]) -> None:
        """The rows in ``slots`` retired or were preempted: they drop their blocks, free again once
        no other row reads them."""
        for slot in slots:
            self.allocator.release(slot)

    def retire(self, num_live: int) -> None:
        """Slots from ``num_live`` on are dead: their tables point at the scratch block."""
        self.block_tables[num_live:].fill_(SCRATCH_BLOCK)

    def move_rows(self, src: Sequence[int], dst: Sequence[int]) -> int:
        """Slots ``dst`` take over rows ``src`` (compaction): a table copy, no KV moves; returns 0 bytes."""
        if not src:
            return 0
        src_t, dst_t = (device_tensor(i, torch.long, self.block_tables.device) for i in (src, dst))
        self.block_tables.index_copy_(0, dst_t, self.block_tables.index_select(0, src_t))
        self.allocator.move(src, dst)
        return 0

    # -- admission ------------------------------------------------------------------------------
    def _flat_positions(self, slots: Sequence[int], counts: Sequence[int],
                        starts: Sequence[int] | None = None) -> torch.Tensor:
        """Flat pool index of positions ``[starts[j], counts[j])`` (default from 0) of each slot (host tables)."""
        index = []
        bs = self.block_size
        for j, (slot, n) in enumerate(zip(slots, counts)):
            blocks = self.allocator.blocks[slot]
            if self.allocator.blocks_for(n) > len(blocks):
                raise RuntimeError(f"slot {slot} holds {len(blocks)} blocks, too few for {n} tokens")
            index.extend(blocks[p // bs] * bs + p % bs for p in range(0 if starts is None else starts[j], n))
        return torch.tensor(index, dtype=torch.long, device=self.block_tables.device)

    def copy_positions(self, slots: Sequence[int], sources: Sequence[int], starts: Sequence[int],
                       stops: Sequence[int]) -> None:
        """Positions ``[starts[j], stops[j])`` of slot ``sources[j]`` into the same positions of slot
        ``slots[j]``, every layer (a shared prompt's partial last block, which each sample writes on)."""
        if not slots:
            return
        src = self._flat_positions(sources, stops, starts)
        dst = self._flat_positions(slots, stops, starts)
        for pool in (*self.keys, *self.values):
            self._write(pool, dst, self._read(pool, src))

    def read_positions(self, slot: int, start: int, stop: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The KV of positions ``[start, stop)`` of ``slot``, per layer ``[1, kv_heads, stop - start,
        head_dim]`` (a copy: a row's partial last block, kept while it waits outside the pool)."""
        index = self._flat_positions([slot], [stop], [start])
        return [tuple(self._read(pool, index).transpose(0, 1)[None] for pool in pair)
                for pair in zip(self.keys, self.values)]

    def write_positions(self, slot: int, start: int, layer_kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """``layer_kv`` (``read_positions``'s) into positions from ``start`` of ``slot`` (its blocks held)."""
        dst = self._flat_positions([slot], [start + layer_kv[0][0].shape[2]], [start])
        self._scatter(dst, layer_kv, lambda src: src[0].transpose(0, 1))  # [n, kv_heads, head_dim]

    def _scatter(self, dst_index: torch.Tensor, layer_kv, gather) -> None:
        for (dst_k, dst_v), (src_k, src_v) in zip(zip(self.keys, self.values), layer_kv):
            for dst, src in ((dst_k, src_k), (dst_v, src_v)):
                self._write(dst, dst_index, gather(src))  # [n, kv_heads, head_dim]

    def admit(
        self, slots: Sequence[int], layer_kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
        lengths: Sequence[int], source_rows: Sequence[int] | None = None, starts: Sequence[int] | None = None,
    ) -> None:
        """Copy a left-padded bucket's KV (per layer ``[rows, kv_heads, width, head_dim]``) into the
        blocks of ``slots``: slot ``slots[j]`` gets bucket row ``source_rows[j]`` (default j), whose
        last ``min(lengths[j], width)`` columns are its positions from 0 (a chunked prompt's head
        first; its whole span follows), from position ``starts[j]`` on (default 0: the positions
        before it are cached blocks the slot reads). The slots hold their blocks already (``grow``)."""
        width = layer_kv[0][0].shape[2]
        counts = [min(n, width) for n in lengths]
        firsts = [0] * len(slots) if starts is None else list(starts)
        source = list(range(len(slots))) if source_rows is None else list(source_rows)
        device = self.block_tables.device
        rows = torch.repeat_interleave(torch.tensor(source, device=device),
                                       torch.tensor([n - s for n, s in zip(counts, firsts)], device=device))
        cols = torch.cat([torch.arange(width - n + s, width, device=device) for n, s in zip(counts, firsts)])
        dst = self._flat_positions(slots, counts, firsts)
        self._scatter(dst, layer_kv, lambda src: src.to(device)[rows, :, cols])  # [sum, kv_heads, head_dim]

    def admit_packed(
        self, slots: Sequence[int], layer_kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
        offsets: Sequence[int], lengths: Sequence[int],
    ) -> None:
        """Copy a packed forward's KV (per layer ``[1, kv_heads, T, head_dim]``) into the blocks of
        ``slots``: slot ``slots[j]`` gets the ``lengths[j]`` tokens from ``offsets[j]`` at positions from 0."""
        device = self.block_tables.device
        tokens = torch.cat([torch.arange(o, o + n, device=device) for o, n in zip(offsets, lengths)])
        dst = self._flat_positions(slots, lengths)
        self._scatter(dst, layer_kv, lambda src: src[0].to(device).index_select(1, tokens).transpose(0, 1))
