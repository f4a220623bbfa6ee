"""The model a command runs: calibrate's and sweep's options that name it, their checks and defaults
(``--device`` as every command reads it), what is known of it before it is built, and building it
(the benches' too). torch and transformers are imported when a function needs them, so the parser
stays torch-free."""
from __future__ import annotations

import argparse
from typing import Any

from rollout_lab.cli.options import DTYPES, add_out_dir, positive_int
from rollout_lab.measure.presets import PRESETS, model_name
from rollout_lab.planner.cost import CostFile, ModelGeometry, setting_metadata


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model options of calibrate and sweep; unset ones are filled by ``build_model``."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--preset", help=f"a real architecture with random weights: {', '.join(sorted(PRESETS))}")
    group.add_argument("--tiny", metavar="FAMILY", help="a tiny random model: qwen2, qwen3, llama, opt (default qwen2)")
    group.add_argument("--model", metavar="PATH", help="a local checkpoint folder (save_pretrained), loaded as "
                                                        "Rollout.from_pretrained loads it")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="model dtype (default: float32 for --tiny, bfloat16 for --preset; for --model "
                             "bfloat16 on CUDA, float32 on CPU, as Rollout.from_pretrained)")
    parser.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda when available)")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="torch CPU threads (default: 1 on a CPU, where more threads make timings noise "
                             "on a busy host; torch's on a GPU)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_out_dir(parser)


def resolve_model_arguments(args: argparse.Namespace) -> None:
    """Check --model/--tiny/--preset/--device and fill their defaults in place; ValueError names a bad
    option. A --model folder gets ``Rollout.from_pretrained``'s checks (``engine.api.loading``), here
    before any other work."""
    import torch  # torch: only the commands that run a model

    from rollout_lab.engine.api.loading import check_model, default_dtype  # torch, as above
    from rollout_lab.measure.models import TINY_FAMILIES  # torch, as above

    model = getattr(args, "model", None)
    if model is not None:
        check_model(model, hub=False)
    elif args.tiny is None and args.preset is None:
        args.tiny = "qwen2"
    if args.tiny is not None and args.tiny not in TINY_FAMILIES:
        raise ValueError(f"unknown --tiny family {args.tiny!r}; expected one of {list(TINY_FAMILIES)}")
    if args.preset is not None and args.preset not in PRESETS:
        raise ValueError(f"unknown --preset {args.preset!r}; expected one of {sorted(PRESETS)}")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type(args.device) == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device!r} but CUDA is not available here; use --device cpu")
    if args.dtype is None and model is not None:
        args.dtype = str(default_dtype(torch.device(args.device))).removeprefix("torch.")
    elif args.dtype is None:
        args.dtype = "float32" if args.tiny else "bfloat16"


def device_type(device: str) -> str:
    """"cpu" or "cuda" for ``--device`` cpu or cuda[:N]; ValueError naming anything else."""
    kind, _, index = device.partition(":")
    if kind not in ("cpu", "cuda") or (index and (kind == "cpu" or not index.isdigit())):
        raise ValueError(f"bad --device {device!r}: expected cpu or cuda[:N]")
    return kind


def check_prefill_graphs_device(args: argparse.Namespace) -> None:
    """``--prefill-graphs`` (calibrate, sweep) captures CUDA graphs: a ValueError on any other device."""
    if device_type(args.device) != "cuda":
        raise ValueError(f"--prefill-graphs captures CUDA graphs; --device is {args.device}")


def model_spec(args: argparse.Namespace) -> str:
    """The resolved --model/--tiny/--preset as ``load_model`` takes it (a bench has no --model)."""
    return getattr(args, "model", None) or (f"tiny-{args.tiny}" if args.tiny else args.preset)


def model_limits(args: argparse.Namespace) -> tuple[Any, str, int | None]:
    """(config, name, context positions) of the resolved model, read without building it."""
    from rollout_lab.measure.models import model_config  # transformers

    config, name = model_config(model_spec(args))
    text = config.get_text_config(decoder=True)
    return config, name, getattr(text, "max_position_embeddings", None)


def read_costs_before_work(path: str, args: argparse.Namespace, config: Any, name: str) -> CostFile:
    """The cost file, checked on what is known before the model is built (name, geometry, dtype,
    device type, whether the prefill forwards are captured); the rest is checked against the built
    model (``engine.model_info.model_metadata``)."""
    cost_file = CostFile.read(path)
    expected = setting_metadata(geometry=ModelGeometry.from_config(config, args.dtype), dtype=args.dtype,
                                model_name=name, device_type=device_type(args.device),
                                prefill_graphs=args.prefill_graphs)
    cost_file.check(expected, override=args.override_costs)
    return cost_file


def build_model(args: argparse.Namespace) -> tuple[Any, str]:
    """The model of the resolved --model/--tiny/--preset in --dtype on --device, and its name; a
    --model folder is loaded as ``Rollout.from_pretrained`` loads it (no tokenizer: the commands
    prompt with token ids)."""
    from rollout_lab.engine.api.loading import load_model_and_tokenizer  # torch
    from rollout_lab.measure.models import load_model  # torch, as above

    if getattr(args, "model", None) is not None:
        model, _ = load_model_and_tokenizer(args.model, dtype=args.dtype, device=args.device, tokenizer=False,
                                            hub=False)
        return model, model_name(args.model)
    return load_model(model_spec(args), dtype=args.dtype, device=args.device)

