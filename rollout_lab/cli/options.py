"""The argparse pieces every command shares: the parser class that reports a bad argument as one
line, the integer, input-path and output-path types, the dtypes, and the workspace option."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import NoReturn

from rollout_lab.workspace import check_output_file, record_paths

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


def out_path(text: str) -> str:
    """An argparse type for an output path (``--out``, ``--out-dir``): not empty, which the commands
    would otherwise take for "not given" and write to the default."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is empty; give a path, or leave the option out for the default")
    return text


def cost_file_path(text: str) -> str:
    """An argparse type for an input cost file (``--costs`` of plan, sweep and the benches): not
    empty, which a command would otherwise take for "not given" and price with its default costs."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is empty; give a cost file's path, or leave --costs out "
                                         "for the default costs")
    return text


def check_override_costs(args: argparse.Namespace) -> None:
    """ValueError for ``--override-costs`` without ``--costs`` (plan, the benches: no default cost file
    to accept), which would otherwise be ignored."""
    if args.override_costs and not args.costs:
        raise ValueError("--override-costs accepts a --costs file of another setting, and no --costs is given: "
                         "add --costs PATH or leave --override-costs out")


def record_out(text: str) -> tuple[Path, Path]:
    """An argparse type for a benchmark's ``--out`` stem: its (json, csv) paths, neither of which
    may exist yet (``workspace.record_paths``) and each of which can be written
    (``workspace.check_output_file``); not empty."""
    if not text.strip():  # required: there is no default to leave it out for (out_path's advice)
        raise argparse.ArgumentTypeError(f"{text!r} is empty; give the record's output stem, e.g. results/rec "
                                         "(for results/rec.json and results/rec.csv)")
    try:
        paths = record_paths(text)
        for path in paths:  # every file it will write, before the model is built
            check_output_file(path, what="--out file")
        return paths
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_out_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out-dir", default=None, type=out_path,
                        help="workspace for every output (default: $ROLLOUT_LAB_OUT, else ./rollout_lab_out)")
