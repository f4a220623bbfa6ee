"""The integer checks every layer shares, so a bad value gets the same error wherever it enters.

    as_int(np.int64(3)) == 3; as_int(True) is None; as_int(3.0) is None
    check_max_new_tokens(16)      # ValueError naming the value unless an int >= 1

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
