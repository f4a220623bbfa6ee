"""A ``generate`` call's progress bar: the tokens its rows have generated, over what their budgets
still allow, drawn by tqdm once the call has run ``DELAY_S`` seconds. The schedulers feed it through
one hook, ``CallProgress.retired``, called after each retirement pass with the rows it retired.

    with progress_hook(requests, enabled=shows_progress(None)) as on_retire:  # None: auto
        ...  # the scheduler calls on_retire(rows) after each retirement pass (None: no bar)

"""
from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

from tqdm.auto import tqdm

from rollout_lab.engine.sched.request import Request

DELAY_S = 2.0  # a call shorter than this draws nothing: a bar would only flicker
MIN_INTERVAL_S = 0.1  # tqdm's own refresh interval: recounting the tokens more often shows nothing


def check_progress(progress: Any, *, name: str = "progress") -> None:
    """ValueError unless ``progress`` is True, False or None (auto)."""
    if progress is not None and not isinstance(progress, bool):
        raise ValueError(f"{name} must be True, False or None (auto: on where a person watches), got {progress!r}")


def shows_progress(progress: bool | None) -> bool:
    """Whether a call draws its bar: ``progress`` when it is a bool; None (auto) where a person is
    watching (stderr is a terminal, or the code runs in a Jupyter/IPython kernel), unless the
    environment variable CI is set."""
    if progress is not None:
        return progress
    if "CI" in os.environ:
        return False
    return _in_kernel() or _is_terminal(sys.stderr)


def _in_kernel() -> bool:
    """Running in a Jupyter/IPython kernel, whose stderr is no terminal but is shown to a person."""
    ipython = sys.modules.get("IPython")  # imported by the kernel; never imported here
    shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
    return getattr(shell, "kernel", None) is not None


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class CallProgress:
    """The bar of one call over its ``requests`` (every row): its total starts at the sum of their
    budgets and drops by a row's unused budget when the row stops early (EOS, stop ids or strings), so
    it moves with every decode step and ends full. A preempted row keeps its tokens counted."""

    def __init__(self, requests: Sequence[Request]):
        self.requests = list(requests)
        self.total = sum(r.max_tokens for r in self.requests)
        self.bar = tqdm(total=self.total, unit="tok", desc="generate", delay=DELAY_S, leave=False,
                        dynamic_ncols=True, mininterval=MIN_INTERVAL_S)
        self._counted_at = -float("inf")

    def retired(self, rows: Sequence[Request]) -> None:
        """After a retirement pass: ``rows`` finished (maybe none); every row's tokens so far are
        counted, at most every ``MIN_INTERVAL_S`` (the count walks every row)."""
        dropped = sum(r.max_tokens - r.num_generated for r in rows)
        if dropped:
            self.total -= dropped
            self.bar.total = self.total
        now = time.monotonic()
        if now - self._counted_at >= MIN_INTERVAL_S:
            self._counted_at = now
            self.bar.update(sum(r.num_generated for r in self.requests) - self.bar.n)

    def close(self) -> None:
        """Count the last tokens, then take the bar down."""
        self.bar.update(sum(r.num_generated for r in self.requests) - self.bar.n)
        self.bar.close()


@contextmanager
def progress_hook(requests: Sequence[Request], *, enabled: bool) -> Iterator[Callable[[Sequence[Request]], None] | None]:
    """The schedulers' ``on_retire`` hook of a bar over ``requests`` inside the block (None when not
    ``enabled``); the bar is taken down after it, also when the block raises."""
    if not enabled:
        yield None
        return
    progress = CallProgress(requests)
    try:
        yield progress.retired
    finally:
        progress.close()
