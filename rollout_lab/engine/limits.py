"""The limits a size meets before anything is allocated: the model's context, and the memory of the
device (or the host) that will hold what the size asks for. ``Rollout`` and the measure runs read
them from the built model (``ModelLimits.of_model``), the command line from the config before the
model is built (``ModelLimits.of_config``): one check, one message, wherever a size enters.

    limits = ModelLimits.of_model(model)
    limits.check_context("max_new_tokens", 4096, positions=900 + 4096, what="the longest prompt (900) "
                         "and max_new_tokens", most=limits.max_positions - 900)
    limits.check_memory("num_seqs", 10**9, unit_bytes=640 * limits.kv_bytes_per_token, unit="rows",
                        what="the KV cache of 1000000000 rows x 640 positions")
    # ValueError: num_seqs=1000000000: the KV cache of ... would take 596.0 GiB; this host has 22.3 GiB
    # available: at most 37400 rows

Available memory is what is free now: on CUDA ``torch.cuda.mem_get_info``'s free bytes; on a CPU
the host's (``/proc/meminfo``'s MemAvailable, else ``os.sysconf``); where neither answers (another
device type, a host without either) ``FALLBACK_MEMORY_BYTES``, and the message says it was assumed.
Prompts and generated tokens live on the host as Python lists (``HOST_TOKEN_BYTES`` a token) and
are checked against the host's memory whatever the device.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from rollout_lab.planner.cost import ModelGeometry

# the memory assumed of a device, or a host, that answers no memory query: a size past it is refused
FALLBACK_MEMORY_BYTES = 64 * 2**30
HOST_TOKEN_BYTES = 36  # a token id in a Python list: an 8-byte pointer and a 28-byte int object
# rows (requests x samples) of one generate call at most: each row is a Request built, planned and
# tracked in Python before and during the decode, so that share of a call grows with its rows whatever
# the device; rows are independent, so a larger batch is several calls
MAX_ROWS = 2**20
LOGIT_BYTES = 4  # logits are compared and reduced in fp32


def host_available_bytes() -> int | None:
    """The host's available memory (``/proc/meminfo``'s MemAvailable, else free pages x page size
    from ``os.sysconf``); None where neither answers."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # no such name on this platform
        return None


def available_memory(device: torch.device | str, *, host: bool = False) -> tuple[int, str]:
    """(bytes available now, what the message calls them) on ``device``, or on the host with
    ``host``; ``FALLBACK_MEMORY_BYTES`` where no query answers. ValueError for CUDA where there is none."""
    device = torch.device(device)
    if device.type == "cuda" and not host:
        if not torch.cuda.is_available():
            raise ValueError(f"device {device} but CUDA is not available here; use cpu")
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), f"{device} has"
    if device.type == "cpu" or host:
        free = host_available_bytes()
        if free is not None:
            return free, "this host has"
        where = "this host"
    else:
        where = str(device)
    return FALLBACK_MEMORY_BYTES, f"{where} answers no memory query, so rollout_lab assumes"


def format_bytes(num_bytes: float) -> str:
    """``num_bytes`` in the largest binary unit that keeps it >= 1 ("596.0 GiB")."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(value) < 1024 or unit == "PiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class ModelLimits:
    """What bounds a size on one model and device: its context (``max_positions``; None = no
    limit), its KV bytes per token, its vocabulary (logits) and the device."""

    max_positions: int | None
    kv_bytes_per_token: int
    vocab_size: int
    device: torch.device

    @classmethod
    def of_config(cls, config: Any, *, dtype: Any, device: torch.device | str) -> "ModelLimits":
        """The limits of a model of ``config`` in ``dtype`` on ``device``, before it is built."""
        text = config.get_text_config(decoder=True) if callable(getattr(config, "get_text_config", None)) else config
        geometry = ModelGeometry.from_config(text, dtype)
        return cls(getattr(text, "max_position_embeddings", None), geometry.kv_bytes_per_token,
                   int(getattr(text, "vocab_size", 0) or 0), torch.device(device))

    @classmethod
    def of_model(cls, model: torch.nn.Module) -> "ModelLimits":
        """The limits of a built model, on its parameters' device."""
        param = next(model.parameters())
        limits = cls.of_config(model.config, dtype=param.dtype, device=param.device)
        vocab = model.get_input_embeddings().weight.shape[0]  # the embedding's rows: what the logits hold
        return ModelLimits(limits.max_positions, limits.kv_bytes_per_token, int(vocab), param.device)

    def check_context(self, name: str, value: object, *, positions: int, what: str, most: object = None,
                      valid: str | None = None) -> None:
        """ValueError naming ``name``=``value`` when ``what`` (the rows it sets) would take more than
        the model's context: ``positions`` positions; ``most`` is the largest valid value, when one
        is (an int below 1: none is, beside the other sizes), or ``valid`` says what is."""
        if self.max_positions is None or positions <= self.max_positions:
            return
        if valid is None and most is not None:
            valid = "no value of it fits beside the other sizes" if isinstance(most, int) and most < 1 \
                else f"at most {name}={most}"
        raise ValueError(f"{name}={value}: {what} would take {positions} positions, past the model's context of "
                         f"{self.max_positions}" + ("" if valid is None else f": {valid}"))

    def check_memory(self, name: str, value: object, *, unit_bytes: int, count: int | None = None, unit: str,
                     what: str, host: bool = False) -> None:
        """ValueError naming ``name``=``value`` when ``count`` (``value`` when None) ``unit`` of
        ``unit_bytes`` each (``what``: "the KV cache of 8 rows x 640 positions") do not fit the
        available memory of the device, or of the host with ``host``; the message says how many fit."""
        count = int(value) if count is None else count  # type: ignore[call-overload]
        need = count * unit_bytes
        available, holder = available_memory(self.device, host=host)
        if need > available:
            raise ValueError(f"{name}={value}: {what} would take {format_bytes(need)}; {holder} "
                             f"{format_bytes(available)} available: at most {available // max(1, unit_bytes)} {unit}")

    def check_kv(self, name: str, value: object, *, rows: int, positions: int, unit: str = "rows") -> None:
        """``check_memory`` of an aligned KV cache of ``rows`` x ``positions`` on the device."""
        self.check_memory(name, value, count=rows, unit_bytes=positions * self.kv_bytes_per_token, unit=unit,
                          what=f"the KV cache of {rows} rows x {positions} positions")

    def check_host_tokens(self, name: str, value: object, *, rows: int, tokens_per_row: int,
                          unit: str = "rows") -> None:
        """``check_memory`` of ``rows`` x ``tokens_per_row`` token ids held on the host."""
        self.check_memory(name, value, count=rows, unit_bytes=tokens_per_row * HOST_TOKEN_BYTES, unit=unit,
                          what=f"{rows} rows of {tokens_per_row} token ids on the host", host=True)


def check_call_rows(samples: Sequence[int]) -> None:
    """ValueError when a call of ``samples[r]`` samples of request r holds more than ``MAX_ROWS`` rows,
    naming num_samples, the requests, the rows and the most allowed; before any row is built."""
    rows = sum(samples)
    if rows <= MAX_ROWS:
        return
    counts = set(samples)
    given = f"num_samples={counts.pop()}" if len(counts) == 1 else f"num_samples (SamplingParams.n) up to {max(samples)}"
    most = MAX_ROWS // len(samples)
    raise ValueError(f"{given} x {len(samples)} requests = {rows} rows, more than the {MAX_ROWS} rows one call "
                     f"takes: " + (f"give at most num_samples={most} for {len(samples)} requests, or " if most else "")
                     + f"split the requests over calls of at most {MAX_ROWS} rows")


def rows_at_once(num_rows: int, *, mode: str, slots: int | None) -> int:
    """The fewest rows a call of ``num_rows`` in ``mode`` on ``slots`` (``continuous_batch_size``)
    holds at once: its slots; else every row on an aligned route, and one where the paged pool (or
    the route auto picks) follows the memory."""
    if slots is not None:
        return min(slots, num_rows)
    return 1 if mode in ("paged", "auto") else num_rows


def check_cache_sizes(limits: ModelLimits, *, cache_capacity: int | None, kv_cache_tokens: int | None) -> None:
    """A ``RolloutConfig``'s cache sizes against the model: ``cache_capacity`` no wider than the
    context (a request never needs more columns), its one row and ``kv_cache_tokens``'s pool within
    the device's available memory. ValueError naming the setting and what would be valid."""
    if cache_capacity is not None:
        if limits.max_positions is not None and cache_capacity > limits.max_positions:
            raise ValueError(f"cache_capacity={cache_capacity} is wider than the model's context of "
                             f"{limits.max_positions} positions, which no request can use: give at most "
                             f"{limits.max_positions}, or None (the call's longest prompt and budget)")
        limits.check_memory("cache_capacity", cache_capacity, unit_bytes=limits.kv_bytes_per_token, unit="columns",
                            what=f"one row of {cache_capacity} KV columns")
    if kv_cache_tokens is not None:
        limits.check_memory("kv_cache_tokens", kv_cache_tokens, unit_bytes=limits.kv_bytes_per_token, unit="tokens",
                            what=f"a paged pool of {kv_cache_tokens} tokens")
