"""The integer checks every layer shares, so a bad value gets the same error wherever it enters.

    as_int(np.int64(3)) == 3; as_int(True) is None; as_int(3.0) is None
    check_int(np.int64(8), name="cache_capacity")  # 8, a Python int; ValueError naming the value else
    check_max_new_tokens(16)      # ValueError naming the value unless an int >= 1
    check_context(500, 16, 512, what="request 3")  # ValueError: 516 positions past a 512 context
    budgets_of([8, 512], 2)       # [8, 512]: one budget per request; budgets_of(16, 3) == [16, 16, 16]
    ints_per_request(0, 2, name="min_new_tokens", minimum=0, what="minimums")   # [0, 0]

A value that passes a check is returned as a Python int and that is the value to use: a numpy int
kept as it came overflows in later arithmetic, and a tensor hashes by identity. Pure Python.
"""
from __future__ import annotations

import operator
from typing import Sequence

MAX_INT = 2**63 - 1  # the largest count a tensor's size (int64) holds: past it torch overflows


def as_int(value: object) -> int | None:
    """``value`` as a Python int when it is one: an int, a numpy int or a 0-d integer tensor; None for
    bools (numpy and tensor ones too), floats, arrays of any other shape, tensors without data (the
    meta device) and the rest."""
    if isinstance(value, (bool, float)) or getattr(value, "ndim", 0) != 0 \
            or "bool" in str(getattr(value, "dtype", "")):
        return None
    try:
        return operator.index(value)
    except Exception:  # a foreign __index__ raises its own errors (a meta tensor's: RuntimeError)
        return None


def is_int(value: object) -> bool:
    """An int (numpy ints and 0-d integer tensors included), not a bool or a float."""
    return as_int(value) is not None


def check_int(value: object, *, name: str, minimum: int = 1, maximum: int = MAX_INT, or_none: bool = False) -> int:
    """``value`` as a Python int; ValueError naming ``name``, the value and the valid range unless it
    is an int in [minimum, maximum] (``or_none``: the message says None is valid too; the caller
    lets None through)."""
    number = as_int(value)
    if number is None or not minimum <= number <= maximum:
        if maximum != MAX_INT:
            upper = f" and <= {maximum}"
        else:
            upper = " and <= 2**63 - 1" if number is not None and number > maximum else ""
        raise ValueError(f"{name} must be an int >= {minimum}{upper}{', or None' if or_none else ''}, got {value!r}")
    return number


def check_max_new_tokens(max_new_tokens: object) -> int:
    """``max_new_tokens`` as an int; ValueError unless it is an int >= 1."""
    return check_int(max_new_tokens, name="max_new_tokens")


def check_context(prompt_length: int, max_new_tokens: int, max_positions: int | None, *, what: str) -> None:
    """ValueError naming ``what`` when a prompt plus its budget is longer than the model's context
    (``max_positions``; None = no limit)."""
    if max_positions is not None and prompt_length + max_new_tokens > max_positions:
        raise ValueError(f"{what}: prompt length {prompt_length} + max_new_tokens {max_new_tokens} "
                         f"exceeds the model's context of {max_positions} positions")


def budgets_of(max_new_tokens: object, num_requests: int) -> list[int]:
    """One generation budget per request: an int for all, or one int >= 1 per request (a list, a
    tuple, a 1-D numpy array or tensor); the errors of ``ints_per_request``."""
    return ints_per_request(max_new_tokens, num_requests, name="max_new_tokens", minimum=1, what="budgets")


def ints_per_request(value: object, num_requests: int, *, name: str, minimum: int, what: str) -> list[int]:
    """One int >= ``minimum`` per request: an int for all, or one per request (a list, a tuple, a
    1-D numpy array or tensor).

    ValueError naming ``name``, the request and value, the length mismatch (``what`` the items are
    called: "3 budgets for 8 requests"), or anything else (a dict, a set, a float, a 2-D array, a
    tensor without data).
    """
    if as_int(value) is not None:
        return [check_int(value, name=name, minimum=minimum)] * num_requests
    is_array = getattr(value, "ndim", None) == 1 and callable(getattr(value, "tolist", None))
    if not isinstance(value, (list, tuple, range)) and not is_array:
        raise ValueError(f"{name} must be an int >= {minimum}, or a list of one int >= {minimum} per request; "
                         f"got {value!r}")
    if getattr(value, "is_meta", False):
        raise ValueError(f"{name} {value!r} is on the meta device and holds no values; "
                         "give ints, or a tensor on the CPU")
    items: Sequence[object] = value.tolist() if is_array else value
    if len(items) != num_requests:
        raise ValueError(f"{name} has {len(items)} {what} for {num_requests} requests; "
                         "give an int, or one int per request")
    return [check_int(item, name=f"{name}[{index}]", minimum=minimum) for index, item in enumerate(items)]
