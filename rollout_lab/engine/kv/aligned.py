"""The right-aligned static KV cache of continuous-batching decode.

One key and one value tensor per layer, ``[slots, kv_heads, capacity, head_dim]``, allocated once.
Every live row's next token is written at the same column, the shared ``front``; a row's prompt
KV sits at ``[front - len, front)`` and shorter rows have masked columns on their left. An additive
float mask ``[slots, 1, 1, capacity]`` (0 = attend, dtype min = masked) is the 4-D attention mask
the model gets as is, so it works for both ``sdpa`` and ``eager`` attention.

For CUDA-graph capture of the decode step everything the step touches is a fixed buffer updated in
place: the KV tensors, ``mask``, and ``front`` (a one-element device tensor that the decode step
advances; the cache layers read it and never advance it themselves, so warm-up replays of the same
step rewrite the same column). ``front_int`` is the host's mirror for scheduling.

``hf_cache(num_rows, width)`` gives a transformers ``Cache`` whose layers are views of the first
``num_rows`` slots (slots are kept dense by compaction) that attention reads over the first
``width`` columns only: a decode step at the front attends to columns ``<= front`` and every later
column is masked, so a window that covers the front gives the same attention for less reading.

"""
from __future__ import annotations

from typing import Sequence

import torch
from transformers.cache_utils import Cache, StaticLayer

from rollout_lab.planner.cost import ModelGeometry


def device_tensor(values: Sequence, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Host ``values`` as a tensor on ``device``, without waiting on it: on CUDA from pinned memory by
    an asynchronous copy, where a pageable copy would synchronise the stream (the caching host
    allocator keeps the pinned buffer until its copy has run). The batcher's retire, compact and
    reserve use it, so the host queues them while the steps before still run."""
    pinned = torch.device(device).type == "cuda"
    return torch.tensor(list(values), dtype=dtype, pin_memory=pinned).to(device, non_blocking=True)


class AlignedLayer(StaticLayer):
    """A ``StaticLayer`` over preallocated views that writes one decode token at the shared front."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, front: torch.Tensor, width: int | None = None):
        width = keys.shape[2] if width is None else width
        super().__init__(max_cache_len=width)
        self.keys, self.values = keys, values  # [rows, kv_heads, capacity, head_dim]
        self.width = width  # attention reads columns [0, width)
        self.front = front  # [1] long, shared by every layer
        self.cumulative_length = front
        self.device, self.dtype = keys.device, keys.dtype
        self.batch_size, self.num_heads = keys.shape[:2]
        self.k_head_dim = self.v_head_dim = keys.shape[-1]
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise RuntimeError("AlignedLayer is preallocated")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if key_states.shape[-2] != 1:
            raise RuntimeError(
                f"the aligned cache takes one decode token per row, got {key_states.shape[-2]}; "
                "prefill goes through a temporary cache"
            )
        self.keys.index_copy_(2, self.front, key_states)  # [rows, kv_heads, 1, head_dim]
        self.values.index_copy_(2, self.front, value_states)
        return self.keys[:, :, : self.width], self.values[:, :, : self.width]  # [rows, kv_heads, width, head_dim]

    def get_seq_length(self):
        return self.front

    def crop(self, tokens_to_remove: int) -> None:
        raise RuntimeError("the aligned cache is trimmed with AlignedKVCache.shift_columns")


class AlignedKVCache:
    """Static per-layer KV buffers, the shared front column and the additive mask."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        if capacity < 1 or num_slots < 1:
            raise ValueError(f"capacity and num_slots must be >= 1, got {capacity}, {num_slots}")
        shape = (num_slots, num_kv_heads, capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.masked_value = torch.finfo(dtype).min
        self.mask = torch.full(
            (num_slots, 1, 1, capacity), self.masked_value, dtype=dtype, device=device
        )  # [slots, 1, 1, capacity]
        self.front = torch.zeros(1, dtype=torch.long, device=device)
        self.front_int = 0
        self.capacity = capacity
        self.num_slots = num_slots
        self.row_starts = [0] * num_slots  # first valid column of each slot (host)
        # the same on the device, for span attention (engine.kernels.span); a dead slot holds
        # ``capacity`` (past any front: it attends to the front column only)
        self.starts = torch.full((num_slots,), capacity, dtype=torch.int32, device=device)
        self._views: dict[tuple[int, int], Cache] = {}

    @classmethod
    def for_model(
        cls, model: torch.nn.Module, *, num_slots: int, capacity: int
    ) -> "AlignedKVCache":
        param = next(model.parameters())
        geometry = ModelGeometry.from_config(model.config.get_text_config(decoder=True), param.dtype)
        return cls(
            num_layers=geometry.num_layers, num_slots=num_slots, num_kv_heads=geometry.num_kv_heads,
            head_dim=geometry.head_dim, capacity=capacity, dtype=param.dtype, device=param.device,
        )

    # -- sizes ------------------------------------------------------------------------------
    @property
    def column_bytes(self) -> int:
        """Bytes of one column of one slot over all layers, keys and values."""
        k = self.keys[0]
        return 2 * len(self.keys) * k.shape[1] * k.shape[3] * k.element_size()

    @property
    def num_bytes(self) -> int:
        return self.column_bytes * self.num_slots * self.capacity

    def hf_cache(self, num_rows: int, width: int | None = None) -> Cache:
        """A transformers Cache over the first ``num_rows`` slots whose attention reads the first
        ``width`` columns (default: all); memoised per (rows, width)."""
        width = self.capacity if width is None else width
        if (num_rows, width) not in self._views:
            layers = [
                AlignedLayer(k[:num_rows], v[:num_rows], self.front, width)
                for k, v in zip(self.keys, self.values)
            ]
            self._views[(num_rows, width)] = Cache(layers=layers)
        return self._views[(num_rows, width)]

    # -- writes -----------------------------------------------------------------------------
    def reset(self) -> None:
        """Mask every column and put the front at 0; stale KV stays but is masked (finite)."""
        self.mask.fill_(self.masked_value)
        self.set_front(0)
        self.row_starts = [0] * self.num_slots
        self.starts.fill_(self.capacity)

    def retire(self, num_live: int) -> None:
        """Slots from ``num_live`` on are dead: span attention reads only their front column."""
        self.starts[num_live:].fill_(self.capacity)

    def _push_starts(self, slots: Sequence[int]) -> None:
        index = device_tensor(slots, torch.long, self.starts.device)
        values = device_tensor([self.row_starts[s] for s in slots], torch.int32, self.starts.device)
        self.starts.index_copy_(0, index, values)

    def set_front(self, front: int) -> None:
        self.front_int = front
        self.front.fill_(front)

    def admit(
        self,
        slots: Sequence[int],
        layer_kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
        lengths: Sequence[int],
        source_rows: Sequence[int] | None = None,
    ) -> None:
        """Copy a left-padded bucket's effective KV spans into ``slots`` at ``[front - len, front)``.

        ``layer_kv[i]`` is layer i's (keys, values) of the bucket, ``[rows, kv_heads, width, head_dim]``.
        Slot ``slots[j]`` gets bucket row ``source_rows[j]`` (default: row j), so one prefilled row
        can be replicated into several slots (shared prefill); ``lengths[j]`` is that row's length,
        its last ``lengths[j]`` columns are its effective span and the rest of the slot is masked.
        """
        width = layer_kv[0][0].shape[2]
        front = self.front_int
        if width > front:
            raise RuntimeError(f"bucket width {width} does not fit left of front {front}")
        device = self.mask.device
        index = torch.tensor(list(slots), dtype=torch.long, device=device)
        cols = torch.arange(width, device=device)
        starts = torch.tensor([width - n for n in lengths], device=device)
        valid = cols[None, :] >= starts[:, None]  # [rows, width]
        keep = valid[:, None, :, None]
        source = None
        if source_rows is not None and list(source_rows) != list(range(len(slots))):
            source = torch.tensor(list(source_rows), dtype=torch.long, device=device)
        for (dst_k, dst_v), (src_k, src_v) in zip(zip(self.keys, self.values), layer_kv):
            for dst, src in ((dst_k, src_k), (dst_v, src_v)):
                if source is not None:
                    src = src.index_select(0, source.to(src.device))  # [slots, kv_heads, width, head_dim]
                window = dst[:, :, front - width : front]  # [slots, kv_heads, width, head_dim]
                old = window.index_select(0, index)
                window.index_copy_(0, index, torch.where(keep, src.to(dst.dtype), old))
        # a chunked prompt's head: only its width is here yet (``lengths`` holds the whole prompt)
        self.open_rows(slots, lengths, visible=[min(n, width) for n in lengths])

    def admit_packed(
        self,
        slots: Sequence[int],
        layer_kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
        offsets: Sequence[int],
        lengths: Sequence[int],
    ) -> None:
        """Scatter packed prompts' KV into ``slots`` at ``[front - len, front)``.

        ``layer_kv[i]`` is layer i's (keys, values) of a packed forward, ``[1, kv_heads, T, head_dim]``;
        slot ``slots[j]`` gets the ``lengths[j]`` tokens from ``offsets[j]`` (several slots may take
        the same prompt: shared prefill). One indexed copy per layer and tensor.
        """
        front, device = self.front_int, self.mask.device
        if max(lengths) > front:
            raise RuntimeError(f"a prompt of {max(lengths)} tokens does not fit left of front {front}")
        sizes = torch.tensor(list(lengths), device=device)
        slot_idx = torch.repeat_interleave(torch.tensor(list(slots), device=device), sizes)  # [sum]
        within = torch.arange(int(sizes.sum()), device=device) - torch.repeat_interleave(
            torch.cumsum(sizes, 0) - sizes, sizes)  # position inside its prompt
        token_idx = torch.repeat_interleave(torch.tensor(list(offsets), device=device), sizes) + within
        col_idx = front - torch.repeat_interleave(sizes, sizes) + within
        for (dst_k, dst_v), (src_k, src_v) in zip(zip(self.keys, self.values), layer_kv):
            for dst, src in ((dst_k, src_k), (dst_v, src_v)):
                values = src[0].index_select(1, token_idx).transpose(0, 1)  # [sum, kv_heads, head_dim]
                dst.permute(0, 2, 1, 3)[slot_idx, col_idx] = values.to(dst.dtype)
        self.open_rows(slots, lengths)

    def open_rows(self, slots: Sequence[int], lengths: Sequence[int],
                   visible: Sequence[int] | None = None) -> None:
        """Rows whose tokens sit at ``[front - length, front)``: each slot's mask opens its last
        ``visible`` (default ``lengths``) columns left of the front and masks the rest, and its start
        (host and device) is ``front - length``. ``admit`` calls it after copying the KV."""
        front, device = self.front_int, self.mask.device
        visible = torch.tensor(list(lengths if visible is None else visible), device=device)
        cols = torch.arange(self.capacity, device=device)
        live = (cols[None, :] >= front - visible[:, None]) & (cols[None, :] < front)  # [slots, capacity]
        row_mask = torch.full((len(slots), self.capacity), self.masked_value, dtype=self.mask.dtype,
                              device=device).masked_fill_(live, 0.0)
        index = torch.tensor(list(slots), dtype=torch.long, device=device)
        self.mask.index_copy_(0, index, row_mask[:, None, None, :])
        for slot, n in zip(slots, lengths):
            self.row_starts[slot] = front - n
        self._push_starts(slots)

    def move_rows(self, src: Sequence[int], dst: Sequence[int]) -> int:
        """Copy slots ``src`` onto slots ``dst`` (compaction); returns the KV bytes moved."""
        if not src:
            return 0
        src_t, dst_t = (device_tensor(i, torch.long, self.mask.device) for i in (src, dst))
        lo = min(self.row_starts[s] for s in src)
        for tensor in (*self.keys, *self.values):
            window = tensor[:, :, lo : self.front_int]
            window.index_copy_(0, dst_t, window.index_select(0, src_t))
        self.mask.index_copy_(0, dst_t, self.mask.index_select(0, src_t))
        for s, d in zip(src, dst):
            self.row_starts[d] = self.row_starts[s]
        self._push_starts(dst)
        return len(src) * (self.front_int - lo) * self.column_bytes

    def shift_columns(self, num_rows: int, delta: int) -> int:
        """Move the live span of the first ``num_rows`` slots by ``delta`` columns (< 0 trims).

        Returns the KV bytes moved. ``front`` moves with the data; logical positions do not change.
        """
        if delta == 0 or num_rows == 0:
            self.set_front(self.front_int + delta)
            return 0
        lo = min(self.row_starts[:num_rows])
        hi = self.front_int
        if lo + delta < 0 or hi + delta > self.capacity:
            raise RuntimeError(
                f"cannot shift columns [{lo}, {hi}) by {delta} within capacity {self.capacity}"
            )
        for tensor in (*self.keys, *self.values):
            rows = tensor[:num_rows]
            rows[:, :, lo + delta : hi + delta] = rows[:, :, lo:hi].clone()
        mask = self.mask[:num_rows]
        span = mask[..., lo:hi].clone()
        mask.fill_(self.masked_value)
        mask[..., lo + delta : hi + delta] = span
        for slot in range(num_rows):
            self.row_starts[slot] += delta
        self.starts[:num_rows].add_(delta)
        self.set_front(hi + delta)
        return num_rows * (hi - lo) * self.column_bytes
