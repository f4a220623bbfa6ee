"""The integer checks every layer shares, so a bad value gets the same error wherever it enters.

    as_int(np.int64(3)) == 3; as_int(True) is None; as_int(3.0) is None
    check_max_new_tokens(16)      # ValueError naming the value unless an int >= 1
    check_context(500, 16, 512, what="request 3")  # ValueError: 516 positions past a 512 context
    budgets_of([8, 512], 2)       # [8, 512]: one budget per request; budgets_of(16, 3) == [16, 16, 16]

Pure Python.
"""
from __future__ import annotations

import operator


def as_int(value: object) -> int | None:
    """``value`` as an int when it is one (numpy ints included); None for bools, floats and the rest."""
    if isinstance(value, (bool, float)):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def is_int(value: object) -> bool:
    """An int (numpy ints included), not a bool or a float."""
    return as_int(value) is not None


def check_max_new_tokens(max_new_tokens: object) -> int:
    """``max_new_tokens`` as an int; ValueError unless it is an int >= 1."""
    value = as_int(max_new_tokens)
    if value is None or value < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    return value


def check_context(prompt_length: int, max_new_tokens: int, max_positions: int | None, *, what: str) -> None:
    """ValueError naming ``what`` when a prompt plus its budget is longer than the model's context
    (``max_positions``; None = no limit)."""
    if max_positions is not None and prompt_length + max_new_tokens > max_positions:
        raise ValueError(f"{what}: prompt length {prompt_length} + max_new_tokens {max_new_tokens} "
                         f"exceeds the model's context of {max_positions} positions")


def budgets_of(max_new_tokens: object, num_requests: int) -> list[int]:
    """One generation budget per request: an int for all, or a sequence of one int >= 1 per request.

    ValueError naming the request and value, or the length mismatch.
    """
    scalar = as_int(max_new_tokens) is not None or not hasattr(max_new_tokens, "__len__")
    if scalar or isinstance(max_new_tokens, (str, bytes)):
        return [check_max_new_tokens(max_new_tokens)] * num_requests
    budgets = list(max_new_tokens.tolist() if hasattr(max_new_tokens, "tolist") else max_new_tokens)
    if len(budgets) != num_requests:
        raise ValueError(f"max_new_tokens has {len(budgets)} budgets for {num_requests} requests; "
                         "give an int, or one int per request")
    out = []
    for index, budget in enumerate(budgets):
        value = as_int(budget)
        if value is None or value < 1:
            raise ValueError(f"max_new_tokens[{index}] must be an int >= 1, got {budget!r}")
        out.append(value)
    return out
