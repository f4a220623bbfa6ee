"""Command-line options that choose and build a model: shared by ``rollout-lab calibrate`` and ``sweep``.

    add_model_arguments(parser)       # --preset | --tiny, --dtype, --device, --threads, --no-progress
    args = parser.parse_args(argv)
    resolve_model_arguments(args)     # fills the defaults: tiny qwen2, its dtype, cuda when available
    model, name = build_model(args)   # SystemExit naming a bad --device, --tiny or --preset first

``--preset`` is a real architecture with random weights, ``--tiny`` a tiny random model.
"""
from __future__ import annotations

import argparse
from typing import Any

DTYPES = ("float32", "bfloat16", "float16")


def build_model(args: argparse.Namespace) -> tuple[Any, str]:
    """The model of --preset/--tiny in --dtype on --device, and its name; validates first."""
    import torch

    from rollout_lab import models

    check_device(args.device)
    dtype = getattr(torch, args.dtype)
    if args.tiny:
        if args.tiny not in models.TINY_FAMILIES:
            raise SystemExit(f"error: unknown --tiny family {args.tiny!r}; expected one of {list(models.TINY_FAMILIES)}")
        return models.tiny_model(args.tiny, dtype=dtype).to(args.device), f"tiny-{args.tiny}"
    if args.preset not in models.PRESETS:
        raise SystemExit(f"error: unknown --preset {args.preset!r}; expected one of {sorted(models.PRESETS)}")
    return models.from_preset(args.preset, dtype=dtype, device=args.device), args.preset


def check_device(device: str) -> None:
    """SystemExit unless ``device`` is cpu, or cuda[:N] with CUDA available."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise SystemExit(f"error: bad --device {device!r}: {err}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"error: --device {device!r} but CUDA is not available here; use --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise SystemExit(f"error: --device {device!r}: expected cpu or cuda[:N]")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the model options; their defaults are None until ``resolve_model_arguments``."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--preset", help="a real architecture with random weights, e.g. qwen2.5-3b")
    group.add_argument("--tiny", metavar="FAMILY", help="a tiny random model: qwen2, qwen3, llama, opt (default qwen2)")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="model dtype (default: float32 for --tiny, bfloat16 for --preset)")
    parser.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda when available)")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="torch CPU threads (default: torch's); 1 steadies timings on a busy host")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def resolve_model_arguments(args: argparse.Namespace) -> None:
    """Fill the unset model options in place and apply --threads."""
    import torch

    if not args.preset and not args.tiny:
        args.tiny = "qwen2"
    if args.dtype is None:
        args.dtype = "float32" if args.tiny else "bfloat16"
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.threads is not None:
        torch.set_num_threads(args.threads)


def positive_int(text: str) -> int:
    """An argparse type: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value
