"""The argparse pieces every command shares: the parser class that reports a bad argument as one
line, the integer and record-output types, the dtypes, and the workspace option."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import NoReturn

from rollout_lab.workspace import record_paths

DTYPES = ("float32", "bfloat16", "float16")


class Parser(argparse.ArgumentParser):
    """argparse, with a bad argument reported as every other user error is: one line, status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {self.prog}: {message}\n")


def positive_int(text: str) -> int:
    """An argparse type: an int >= 1."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """An argparse type: an int >= 0."""
    return _int_at_least(text, 0)


def _int_at_least(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
    return value


def record_out(text: str) -> tuple[Path, Path]:
    """An argparse type for a benchmark's ``--out`` stem: its (json, csv) paths, neither of which
    may exist yet (``workspace.record_paths``)."""
    try:
        return record_paths(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_out_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out-dir", default=None,
                        help="workspace for every output (default: $ROLLOUT_LAB_OUT, else ./rollout_lab_out)")
