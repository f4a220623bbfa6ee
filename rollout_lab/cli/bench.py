"""``rollout-lab bench ...``: one benchmark on a tiny or preset model, one record. Each bench is a
measure module's run (``measure.rl``, ``grpo``, ``decode_step``, ``prefill_routes``, ``fidelity``,
``long_tail``, ``trainer_loop``, ``defaults``, ``prefix_sharing``, ``partial_rollouts``, ``tool_episodes``), whose docstring gives its H200 command.

A bench's options take their choices and defaults from its measure module (torch): ``BenchParser``
adds them when that bench parses, so `plan` and `bench --help` import no torch."""
from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, Sequence

from rollout_lab.cli.model import build_model, device_type, model_limits, read_costs_before_work
from rollout_lab.cli.options import Parser, check_override_costs, cost_file_path, positive_int, record_out
from rollout_lab.measure.presets import PRESETS
from rollout_lab.measure.records import decode_step_rows, grpo_rows, rl_throughput_rows
from rollout_lab.measure.workloads import DATASETS, SAMPLED_WORKLOADS, WORKLOADS
from rollout_lab.planner.cost import CostFile
from rollout_lab.workspace import write_record


def _rl_options(p: argparse.ArgumentParser) -> None:
    from rollout_lab.engine.runner.steppers import DECODE_MODES  # torch: a bench's options, when it parses
    from rollout_lab.measure.rl import NANO_VLLM_MODEL, RL_DEFAULTS, RL_PATHS  # torch, as above

    d = RL_DEFAULTS  # run_rl's own defaults
    _add_bench_options(p, preset=NANO_VLLM_MODEL)
    _add_uniform_lengths(p, d, what="prompt length and budget")
    p.add_argument("--slots", type=positive_int, default=d["slots"], help="continuous_batch_size (default: every request)")
    p.add_argument("--decode", default=d["decode"], choices=DECODE_MODES, help="our decode stepper")
    p.add_argument("--decode-widths", type=int, default=d["decode_widths"],
                   help="attention windows of 'ours' (default: the engine's)")
    p.add_argument("--peer-calls", type=positive_int, default=d["peer_calls"],
                   help="HF's timed calls, no warm-up (default %(default)s)")
    _add_run_options(p, d, paths=RL_PATHS)


def cmd_bench_rl(args: argparse.Namespace) -> int:
    from rollout_lab.measure.rl import RL_DEFAULTS, check_rl_settings, run_rl  # torch

    settings = {k: getattr(args, k) for k in RL_DEFAULTS}
    check_rl_settings(**settings, limits=_model_limits(args))
    _run_bench(args, rl_throughput_rows, lambda model, name, save: run_rl(
        model, model_name=name, dtype=args.dtype, save=save, config=_bench_config(args), **_bench_provenance(args),
        **settings))
    return 0


def _grpo_options(p: argparse.ArgumentParser) -> None:
    from rollout_lab.measure.grpo import GRPO_DEFAULTS, GRPO_PATHS  # torch: a bench's options, when it parses

    d = GRPO_DEFAULTS  # run_grpo's own defaults
    _add_bench_options(p, preset="qwen2.5-3b")
    p.add_argument("--dataset", default=d["dataset"], choices=DATASETS, help="prompt-length distribution")
    p.add_argument("--num-prompts", type=int, default=d["num_prompts"], help="unique prompts (default %(default)s)")
    p.add_argument("--num-samples", type=int, default=d["num_samples"], help="samples per prompt (default %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=d["max_new_tokens"], help="tokens per sample (default %(default)s)")
    p.add_argument("--scale", type=float, default=d["scale"], help="multiply every prompt length (CPU checks)")
    p.add_argument("--temperature", type=float, default=d["temperature"], help="sampling temperature (default %(default)s)")
    p.add_argument("--top-p", type=float, default=d["top_p"], help="nucleus mass (default %(default)s = off)")
    _add_bench_costs(p)
    _add_run_options(p, d, paths=GRPO_PATHS)


def cmd_bench_grpo(args: argparse.Namespace) -> int:
    from rollout_lab.measure.grpo import GRPO_DEFAULTS, check_grpo_settings, run_grpo  # torch

    settings = {k: getattr(args, k) for k in GRPO_DEFAULTS}
    check_grpo_settings(**settings, limits=_model_limits(args))
    cost_file = _read_costs(args, prefill_graphs=None)
    if args.tiny:  # tiny shapes: more threads only contend (a process-wide torch setting, as --threads)
        import torch  # torch, as above

        torch.set_num_threads(1)

    def run(model: Any, name: str, save: Callable[[dict], str]) -> dict[str, Any]:  # one write, at the end
        costs = _checked_costs(cost_file, model, name, prefill_graphs=None, override=args.override_costs)
        return run_grpo(model, model_name=name, dtype=args.dtype, costs=costs, costs_source=args.costs,
                        config=_bench_config(args), **_bench_provenance(args), **settings)

    record = _run_bench(args, grpo_rows, run)
    print(f"ratios: {record['ratios']}  checks: {record['checks']}")
    return 0


def _decode_step_options(p: argparse.ArgumentParser) -> None:
    from rollout_lab.measure.decode_step import DECODE_STEP_DEFAULTS  # torch: a bench's options, when it parses

    d = DECODE_STEP_DEFAULTS  # run_decode_step's own defaults
    _add_bench_options(p, preset="qwen2.5-3b")
    p.add_argument("--cases", nargs="+", type=_slots_by_span, default=list(d["cases"]), metavar="SLOTSxSPAN",
                   help="S slots whose rows all hold L live columns (default 32x80 128x710)")
    _add_variants(p, d)
    p.add_argument("--steps", type=positive_int, default=d["steps"], help="timed steps per variant (default %(default)s)")


def cmd_bench_decode_step(args: argparse.Namespace) -> int:
    from rollout_lab.measure.decode_step import (DECODE_STEP_DEFAULTS,  # torch
                                                 check_decode_step_settings, run_decode_step)

    settings = {k: getattr(args, k) for k in DECODE_STEP_DEFAULTS}
    check_decode_step_settings(**settings, limits=_model_limits(args))
    _run_bench(args, decode_step_rows, lambda model, name, save: run_decode_step(
        model, model_name=name, dtype=args.dtype, save=save, **_bench_provenance(args), **settings))
    return 0


def _checked_by(check: Callable[[str], None]) -> Callable[[str], str]:
    """An argparse ``type`` taking a word ``check`` accepts, whose ValueError is argparse's message."""
    def parse(text: str) -> str:
        try:
            check(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
        return text
    return parse


def _slots_by_span(text: str) -> tuple[int, int]:
    try:
        slots, span = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a case is SLOTSxSPAN such as 32x80, got {text!r}") from None
    return slots, span


def _prefill_routes_options(p: argparse.ArgumentParser) -> None:
    from rollout_lab.measure.prefill_routes import (PREFILL_ROUTES,  # torch: a bench's options, when it parses
                                                    PREFILL_ROUTES_DEFAULTS)

    d = PREFILL_ROUTES_DEFAULTS  # run_prefill_routes's own defaults
    _add_bench_options(p, preset="qwen2.5-3b")
    p.add_argument("--batch-sizes", nargs="+", type=positive_int, default=list(d["batch_sizes"]),
                   help="prompts per batch, each drawn lognormal and bimodal (default %(default)s)")
    p.add_argument("--repetitions", type=positive_int, default=d["repetitions"],
                   help="timed rounds after one warm-up (default %(default)s)")
    p.add_argument("--routes", nargs="+", default=list(d["routes"]), choices=PREFILL_ROUTES,
                   help="prefill routes to run (default all three)")
    _add_bench_costs(p)
    p.add_argument("--prefill-graphs", action="store_true",
                   help="CUDA: buckets at the shape-class ladder, each class's forward captured (as sweep --prefill-graphs)")


def cmd_bench_prefill_routes(args: argparse.Namespace) -> int:
    from rollout_lab.measure.prefill_routes import (PREFILL_ROUTES_DEFAULTS,  # torch
                                                    check_prefill_routes_settings, run_prefill_routes)

    if args.prefill_graphs and args.tiny:
        raise ValueError("--prefill-graphs captures CUDA graphs: give a preset on a CUDA device, not --tiny")
    settings = {k: getattr(args, k) for k in PREFILL_ROUTES_DEFAULTS}
    check_prefill_routes_settings(**settings, limits=_model_limits(args))
    cost_file = _read_costs(args, prefill_graphs=args.prefill_graphs)

    def run(model: Any, name: str, save: Callable[[dict], str]) -> dict[str, Any]:
        costs = _checked_costs(cost_file, model, name, prefill_graphs=args.prefill_graphs,
                               override=args.override_costs)
        return run_prefill_routes(model, model_name=name, dtype=args.dtype, costs=costs, costs_source=args.costs,
                                  prefill_graphs=args.prefill_graphs, save=save, **_bench_provenance(args),
                                  **settings)

    _run_bench(args, lambda record: record["rows"], run)
    return 0


def _logits_options(p: argparse.ArgumentParser) -> None:
    from rollout_lab.measure.fidelity import CACHES, LOGITS_DEFAULTS  # torch: a bench's options, when it parses

    d = LOGITS_DEFAULTS  # run_logits_check's own defaults
    _add_bench_options(p, preset="qwen3-0.6b")
    _add_uniform_lengths(p, d, what="prompt length")
    p.add_argument("--steps", type=positive_int, default=d["steps"], help="forced tokens per request (default %(default)s)")
    _add_variants(p, d)
    p.add_argument("--cache", default=d["cache"], choices=CACHES,
                   help="the KV cache the decode step reads: the aligned one, or the paged route's")


def cmd_bench_logits(args: argparse.Namespace) -> int:
    from rollout_lab.measure.fidelity import (LOGITS_DEFAULTS,  # torch
                                              check_logits_settings, logits_rows, run_logits_check)

    settings = {k: getattr(args, k) for k in LOGITS_DEFAULTS}
    check_logits_settings(**settings, limits=_model_limits(args))
    _run_bench(args, logits_rows, lambda model, name, save: run_logits_check(
        model, model_name=name, dtype=args.dtype, save=save, **_bench_provenance(args), **settings))
    return 0


def _long_tail_options(p: argparse.ArgumentParser) -> None:
    from rollout_lab.measure.long_tail import (  # torch: a bench's options, when it parses
        LONG_TAIL_DEFAULTS, LONG_TAIL_PATHS)

    d = LONG_TAIL_DEFAULTS  # run_long_tail's own defaults
    _add_bench_options(p, preset="qwen2.5-0.5b")
    p.add_argument("--num-prompts", type=positive_int, default=d["num_prompts"],
                   help="prompts, drawn with replacement (default %(default)s)")
    p.add_argument("--dataset", default=d["dataset"], choices=DATASETS, help="whose prompt lengths (default %(default)s)")
    p.add_argument("--hazard", type=float, default=d["hazard"], help="per-step EOS probability, in (0, 0.5] (default 1/295)")
    p.add_argument("--max-new-tokens", type=positive_int, default=d["max_new_tokens"],
                   help="every row's budget (default %(default)s)")
    p.add_argument("--slots", type=positive_int, default=d["slots"],
                   help="slots of aligned_128 and paged_128 (default %(default)s)")
    _add_run_options(p, d, paths=LONG_TAIL_PATHS)


def cmd_bench_long_tail(args: argparse.Namespace) -> int:
    from rollout_lab.measure.long_tail import (LONG_TAIL_DEFAULTS, LONG_TAIL_PATHS,  # torch
                                              check_long_tail_settings, long_tail_rows, run_long_tail)

    settings = {k: getattr(args, k) for k in LONG_TAIL_DEFAULTS}
    check_long_tail_settings(**settings, limits=_model_limits(args))
    compiled = [p for p in args.paths if LONG_TAIL_PATHS[p].get("compile") in (True, "layers")]
    if compiled and (args.device or ("cpu" if args.tiny else "cuda")) == "cpu":
        raise ValueError(f"paths {compiled} compile the CUDA-graph decode step; --device is cpu "
                         "(leave them out, or run on a CUDA device)")
    _run_bench(args, long_tail_rows, lambda model, name, save: run_long_tail(
        model, model_name=name, dtype=args.dtype, save=save, config=_bench_config(args), **_bench_provenance(args),
        **settings))
    return 0


def _partial_rollouts_options(p: argparse.ArgumentParser) -> None:
    from rollout_lab.measure.partial_rollouts import PARTIAL_ROLLOUT_DEFAULTS  # torch: when it parses

    d = PARTIAL_ROLLOUT_DEFAULTS  # run_partial_rollouts' own defaults
    _add_bench_options(p, preset="qwen2.5-0.5b")
    p.add_argument("--num-prompts", type=positive_int, default=d["num_prompts"],
                   help="rows of every call (default %(default)s)")
    p.add_argument("--dataset", default=d["dataset"], choices=DATASETS, help="whose prompt lengths (default %(default)s)")
    p.add_argument("--hazard", type=float, default=d["hazard"], help="per-step EOS probability, in (0, 0.5] (default 1/295)")
    p.add_argument("--max-new-tokens", type=positive_int, default=d["max_new_tokens"],
                   help="every row's budget over its whole response (default %(default)s)")
    p.add_argument("--slots", type=positive_int, default=d["slots"], help="slots of the paged pool (default %(default)s)")
    p.add_argument("--finish-fraction", type=float, default=d["finish_fraction"],
                   help="a call returns once this fraction of its rows finished, in (0, 1] (default %(default)s)")
    p.add_argument("--num-calls", type=positive_int, default=d["num_calls"],
                   help="consecutive calls of the loops (default %(default)s)")
    p.add_argument("--seed", type=int, default=d["seed"], help="seed of the workload and of the sampling")
    p.add_argument("--reps", type=positive_int, default=d["reps"],
                   help="timed one-call runs per path after one warm-up (default %(default)s)")


def cmd_bench_partial_rollouts(args: argparse.Namespace) -> int:
    from rollout_lab.measure.partial_rollouts import (PARTIAL_ROLLOUT_DEFAULTS,  # torch
                                                      check_partial_settings, partial_rollout_rows,
                                                      run_partial_rollouts)

    settings = {k: getattr(args, k) for k in PARTIAL_ROLLOUT_DEFAULTS}
    check_partial_settings(**settings, limits=_model_limits(args))
    _run_bench(args, partial_rollout_rows, lambda model, name, save: run_partial_rollouts(
        model, model_name=name, dtype=args.dtype, save=save, config=_bench_config(args), **_bench_provenance(args),
        **settings))
    return 0


def _tool_episodes_options(p: argparse.ArgumentParser) -> None:
    from rollout_lab.measure.tool_episodes import TOOL_EPISODES  # torch: when it parses

    d = TOOL_EPISODES
    _add_bench_options(p, preset=d["preset"])
    p.add_argument("--num-prompts", type=positive_int, default=d["num_prompts"], help="episodes (default %(default)s)")
    p.add_argument("--min-len", type=positive_int, default=d["min_len"], help="shortest prompt (default %(default)s)")
    p.add_argument("--max-len", type=positive_int, default=d["max_len"], help="longest prompt (default %(default)s)")
    p.add_argument("--max-new-tokens", type=positive_int, default=d["max_new_tokens"],
                   help="the model's tokens per episode (default %(default)s)")
    p.add_argument("--max-turns", type=positive_int, default=d["max_turns"], help="model turns (default %(default)s)")
    p.add_argument("--answer-min", type=positive_int, default=d["answer_min"],
                   help="shortest environment answer (default %(default)s)")
    p.add_argument("--answer-max", type=positive_int, default=d["answer_max"],
                   help="longest environment answer (default %(default)s)")
    p.add_argument("--latencies-ms", type=float, nargs="+", default=[0.0, 50.0],
                   help="environment latencies, one run each; the first is the baseline (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload, the answers and the sampling")


def cmd_bench_tool_episodes(args: argparse.Namespace) -> int:
    from rollout_lab.measure.tool_episodes import (check_tool_episodes_settings, run_tool_episodes,  # torch
                                                   tool_episode_rows)

    names = ("num_prompts", "min_len", "max_len", "max_new_tokens", "max_turns", "answer_min", "answer_max")
    overrides = {k: getattr(args, k) for k in names}
    latencies = tuple(args.latencies_ms)
    check_tool_episodes_settings(seed=args.seed, latencies_ms=latencies, limits=_model_limits(args), **overrides)
    record = _run_bench(args, tool_episode_rows, lambda model, name, save: run_tool_episodes(
        model, model_name=name, dtype=args.dtype, seed=args.seed, latencies_ms=latencies, config=None, **overrides))
    print(f"ratios {record['ratios']}  targets {record['issue_targets']}")
    return 0


def _trainer_loop_options(p: argparse.ArgumentParser) -> None:
    from rollout_lab.engine.sample.processors import LOGPROB_MODES  # torch: a bench's options, when it parses
    from rollout_lab.engine.api.config import MODES  # torch, as above
    from rollout_lab.measure.trainer_loop import TRAIN_MODES, TRAINER_LOOP_DEFAULTS, check_train_mode  # torch, as above

    d = TRAINER_LOOP_DEFAULTS  # run_trainer_loop's own defaults
    _add_bench_options(p, preset="qwen2.5-0.5b")
    p.add_argument("--dataset", default=d["dataset"], choices=DATASETS, help="prompt-length distribution")
    p.add_argument("--num-prompts", type=positive_int, default=d["num_prompts"], help="prompts (default %(default)s)")
    p.add_argument("--num-samples", type=positive_int, default=d["num_samples"],
                   help="samples per prompt (default %(default)s)")
    p.add_argument("--max-new-tokens", type=positive_int, default=d["max_new_tokens"],
                   help="tokens per sample (default %(default)s)")
    p.add_argument("--scale", type=float, default=d["scale"], help="multiply every prompt length (CPU checks)")
    p.add_argument("--iterations", type=positive_int, default=d["iterations"],
                   help="rollout + trainer steps after one warm-up rollout (default %(default)s)")
    p.add_argument("--lr", type=float, default=d["lr"], help="AdamW learning rate (default %(default)s)")
    p.add_argument("--train-rows", type=positive_int, default=d["train_rows"],
                   help="rows per trainer micro-batch (default: every row at once)")
    p.add_argument("--logprobs-mode", default=d["logprobs_mode"], choices=LOGPROB_MODES,
                   help="the rollout's logprobs, compared with the trainer's forward (default %(default)s)")
    p.add_argument("--train-mode", default=d["train_mode"], type=_checked_by(check_train_mode),
                   metavar="{" + ",".join(TRAIN_MODES) + "}",
                   help="the trainer step's mode: toggle (train() for the step, eval() for the rollout) or eval "
                        "throughout; the rollout is always in eval mode (default %(default)s)")
    p.add_argument("--gradient-checkpointing", action="store_true", help="HF gradient checkpointing on")
    p.add_argument("--assign", action="store_true",
                   help="after each step, replace every parameter through load_state_dict(assign=True)")
    p.add_argument("--mode", default=d["mode"], choices=MODES, help="our route (default %(default)s)")
    p.add_argument("--seed", type=int, default=d["seed"], help="seed of the workload and of the sampling")
    p.add_argument("--batch-invariant", action="store_true",
                   help="RolloutConfig(batch_invariant=True) and the trainer's sequence_logprobs(batch_invariant=True): "
                        "the decode's logprobs are the trainer's forward's, bit for bit (needs --mode paged or auto)")


def cmd_bench_trainer_loop(args: argparse.Namespace) -> int:
    from rollout_lab.measure.trainer_loop import (TRAINER_LOOP_DEFAULTS,  # torch
                                                  check_trainer_loop_settings, run_trainer_loop, trainer_loop_rows)

    settings = {k: getattr(args, k) for k in TRAINER_LOOP_DEFAULTS}
    check_trainer_loop_settings(**settings, limits=_model_limits(args))
    if args.tiny:  # tiny shapes: more threads only contend (a process-wide torch setting, as bench grpo)
        import torch  # torch, as above

        torch.set_num_threads(1)
    _run_bench(args, trainer_loop_rows, lambda model, name, save: run_trainer_loop(
        model, model_name=name, dtype=args.dtype, save=save, config=_bench_config(args), **_bench_provenance(args),
        **settings))
    return 0


def _defaults_options(p: argparse.ArgumentParser) -> None:
    from rollout_lab.measure.defaults import DEFAULTS_BENCH_DEFAULTS  # torch: a bench's options, when it parses

    d = DEFAULTS_BENCH_DEFAULTS  # run_defaults's own defaults
    _add_bench_options(p, preset="qwen2.5-3b")
    p.add_argument("--workloads", nargs="+", default=list(d["workloads"]), choices=WORKLOADS,
                   help="workloads, in order (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=positive_int, default=d["max_new_tokens"],
                   help="tokens per prompt, EOS ignored (default %(default)s)")
    p.add_argument("--repetitions", type=positive_int, default=d["repetitions"],
                   help="timed rounds of both engines after each one's first call (default %(default)s)")
    p.add_argument("--scale", type=float, default=d["scale"], help="multiply every prompt length (CPU checks)")
    p.add_argument("--tuned-costs", metavar="PATH", default=d["tuned_costs"],
                   help="the tuned engine's calibration (`rollout-lab calibrate`; default: reference coefficients)")
    p.add_argument("--seed", type=int, default=d["seed"], help="seed of the workloads' prompts")


def cmd_bench_defaults(args: argparse.Namespace) -> int:
    from rollout_lab.measure.defaults import (DEFAULTS_BENCH_DEFAULTS,  # torch
                                             check_defaults_settings, defaults_rows, run_defaults)

    settings = {k: getattr(args, k) for k in DEFAULTS_BENCH_DEFAULTS}
    # a missing --tuned-costs file too, and the sizes against the model's config, before the model loads
    check_defaults_settings(**settings, limits=_model_limits(args))
    if args.tiny:  # tiny shapes: more threads only contend (a process-wide torch setting, as bench grpo)
        import torch  # torch, as above

        torch.set_num_threads(1)
    record = _run_bench(args, defaults_rows, lambda model, name, save: run_defaults(
        model, model_name=name, dtype=args.dtype, save=save, config=_bench_config(args), **_bench_provenance(args),
        **settings))
    print(f"process first call: {record['process_first_call_ms']:.1f} ms (model loaded to the default's first result)")
    return 0


def _prefix_sharing_options(p: argparse.ArgumentParser) -> None:
    from rollout_lab.measure.prefix_sharing import (  # torch: a bench's options, when it parses
        PREFIX_SHARING_DEFAULTS, PREFIX_SHARING_PATHS)

    d = PREFIX_SHARING_DEFAULTS  # run_prefix_sharing's own defaults
    _add_bench_options(p, preset=None)
    p.add_argument("--workload", default=d["workload"], choices=SAMPLED_WORKLOADS,
                   help="prompts sampled num_samples times each, and the preset they were set for (default %(default)s)")
    p.add_argument("--num-prompts", type=positive_int, default=d["num_prompts"],
                   help="the workload's first N prompts (default: all of them)")
    p.add_argument("--num-samples", type=positive_int, default=d["num_samples"],
                   help="samples per prompt (default: the workload's)")
    p.add_argument("--max-new-tokens", type=positive_int, default=d["max_new_tokens"],
                   help="tokens per sample, EOS ignored (default: the workload's)")
    p.add_argument("--scale", type=float, default=d["scale"], help="multiply every prompt length (CPU checks)")
    p.add_argument("--prompt-lengths", nargs="+", type=positive_int, default=d["prompt_lengths"], metavar="N",
                   help="a sweep over the prefix length: one case per length, every prompt that long, in place of "
                        "the workload's lengths (notebook 03's figure)")
    p.add_argument("--sequential", action="store_true",
                   help="each path alone on the device, its memory released before the next (default: the paths "
                        "interleaved round by round, their pools sharing the device)")
    _add_run_options(p, d, paths=PREFIX_SHARING_PATHS)


def cmd_bench_prefix_sharing(args: argparse.Namespace) -> int:
    from rollout_lab.measure.prefix_sharing import (PREFIX_SHARING_DEFAULTS,  # torch
                                                    check_prefix_sharing_settings, prefix_sharing_rows,
                                                    run_prefix_sharing)

    if args.preset is None and args.tiny is None:
        args.preset = SAMPLED_WORKLOADS[args.workload]["preset"]
    settings = {k: getattr(args, k) for k in PREFIX_SHARING_DEFAULTS}
    check_prefix_sharing_settings(**settings, limits=_model_limits(args))
    if args.tiny:  # tiny shapes: more threads only contend (a process-wide torch setting, as bench grpo)
        import torch  # torch, as above

        torch.set_num_threads(1)
    record = _run_bench(args, prefix_sharing_rows, lambda model, name, save: run_prefix_sharing(
        model, model_name=name, dtype=args.dtype, save=save, config=_bench_config(args), **_bench_provenance(args),
        **settings))
    for case in record["cases"]:
        print(f"prompt length {case['prompt_length'] or case['mean_prompt_length']:g}: ratios {case['ratios']}  "
              f"checks {case['checks']}")
    return 0


# name: (one-line help, its options, its command)
BENCHES: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "rl": ("RL-regime throughput (nano-vllm's shape, per-request budgets): ours, its ablations, HF generate_batch",
           _rl_options, cmd_bench_rl),
    "grpo": ("GRPO-shaped rollouts, N prompts x S samples: shared prefill against unshared and HF",
             _grpo_options, cmd_bench_grpo),
    "decode-step": ("the decode step alone: ms per step at a slot count and live span, per decode lever",
                    _decode_step_options, cmd_bench_decode_step),
    "prefill-routes": ("the three prefill routes (nocb, bucketed, packed) timed side by side on batches of each size",
                       _prefill_routes_options, cmd_bench_prefill_routes),
    "logits": ("teacher-forced logits of our decode step against a plain forward, per decode lever",
               _logits_options, cmd_bench_logits),
    "long-tail": ("sampled RL rows ending at EOS at very different times: the aligned cache against the paged pool",
                  _long_tail_options, cmd_bench_long_tail),
    "partial-rollouts": ("the EOS long tail with finish_fraction: one call and a loop of calls carrying their "
                         "unfinished rows, against full calls", _partial_rollouts_options, cmd_bench_partial_rollouts),
    "tool-episodes": ("multi-turn episodes with an environment (generate(env=...)) against a single-turn call of "
                      "the same tokens, and at an environment latency", _tool_episodes_options, cmd_bench_tool_episodes),
    "trainer-loop": ("rollout alternated with a GRPO trainer step on one model: sync cost, recaptures, logprob mismatch",
                     _trainer_loop_options, cmd_bench_trainer_loop),
    "defaults": ("RolloutConfig() with nothing set against the tuned setting, one Rollout each: ratio and first call",
                 _defaults_options, cmd_bench_defaults),
    "prefix-sharing": ("samples of a prompt on the paged route: its KV blocks copied per sample against shared, "
                       "and the shared read on and off", _prefix_sharing_options, cmd_bench_prefix_sharing),
}


def _run_bench(args: argparse.Namespace, rows: Callable[[dict], list[dict]],
               run: Callable[[Any, str, Callable[[dict], str]], dict[str, Any]]) -> dict[str, Any]:
    """Build the bench's model and ``run(model, name, save)`` it into its record, ``save`` writing
    <out>.json and <out>.csv (the runs save after every path or case) with its card's floor
    (``measure.roofline``: the "roofline" field); then write it once more, print its rows and where
    they went. The unset model options: fp32 on the CPU for --tiny, else bf16 on CUDA."""
    from rollout_lab.measure.roofline import attach_roofline  # torch: a bench's run, when it starts

    _resolve_model_options(args)
    model, name = build_model(args)

    def save(record: dict[str, Any]) -> str:
        attach_roofline(record, model_config=model.config)  # the built model's own weights, whatever its name
        return write_record(args.out, record, rows(record))

    record = run(model, name, save)
    print(save(record), end="")
    print(f"wrote {args.out[0]} and {args.out[1]}")
    return record


def _resolve_model_options(args: argparse.Namespace) -> None:
    """Fill the unset model options in place: fp32 on the CPU for --tiny, else bf16 on CUDA; a
    --device that is neither cpu nor cuda[:N] is a ValueError."""
    args.dtype = args.dtype or ("float32" if args.tiny else "bfloat16")
    args.device = args.device or ("cpu" if args.tiny else "cuda")
    device_type(args.device)


def _model_limits(args: argparse.Namespace) -> Any:
    """The bench model's ``engine.limits.ModelLimits``, read from its config before it is built, so
    a bench's sizes are checked before the model and the prompts take any memory."""
    from rollout_lab.engine.limits import ModelLimits  # torch: a bench's run, when it starts

    _resolve_model_options(args)
    config, _, _ = model_limits(args)
    return ModelLimits.of_config(config, dtype=args.dtype, device=args.device)


def _bench_config(args: argparse.Namespace) -> dict[str, Any]:
    """The model options a record's settings keep beside its run's."""
    return {"preset": args.preset, "tiny": args.tiny, "device": args.device}


def _bench_provenance(args: argparse.Namespace) -> dict[str, Any]:
    """What a record's provenance says ran it: this command, and the options it was given."""
    return {"script": f"rollout-lab bench {args.bench}", "argv": args.bench_argv}


class BenchParser(Parser):
    """One bench's parser. ``add_options(parser)`` adds its options when it first parses (their
    choices and defaults are its measure module's: torch); the options it was given are kept as
    ``bench_argv``, for the record's provenance."""

    def __init__(self, *args: Any, add_options: Callable[[argparse.ArgumentParser], None], **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._add_options: Callable[[argparse.ArgumentParser], None] | None = add_options

    def parse_known_args(self, args: Sequence[str] | None = None,
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        if self._add_options is not None:
            add, self._add_options = self._add_options, None
            add(self)
        namespace, extras = super().parse_known_args(args, namespace)
        namespace.bench_argv = list(sys.argv[1:] if args is None else args)
        return namespace, extras


def _add_bench_options(parser: argparse.ArgumentParser, *, preset: str | None) -> None:
    """--out and the model options of every bench (``_run_bench`` fills the unset ones); ``preset``
    None leaves --preset to the bench (prefix-sharing: its workload's)."""
    from rollout_lab.measure.models import TINY_FAMILIES  # torch: a bench's options, when it parses

    parser.add_argument("--out", required=True, type=record_out,
                        help="output stem: writes <out>.json and <out>.csv (neither may exist)")
    parser.add_argument("--preset", default=preset, choices=sorted(PRESETS),
                        help=f"architecture, random weights (default {preset or 'the preset of --workload'})")
    parser.add_argument("--tiny", choices=TINY_FAMILIES, help="a tiny fp32 CPU model instead of --preset")
    parser.add_argument("--dtype", default=None, help="default bfloat16; float32 with --tiny")
    parser.add_argument("--device", default=None, help="default cuda; cpu with --tiny")


def _add_run_options(parser: argparse.ArgumentParser, defaults: dict[str, Any], *, paths: Sequence[str]) -> None:
    """--mode (where the run takes one), --seed, --reps and --paths of a bench timing several paths
    on one seeded workload (rl, grpo, long-tail); ``defaults`` are its run function's."""
    from rollout_lab.engine.api.config import MODES  # torch: a bench's options, when it parses

    if "mode" in defaults:
        parser.add_argument("--mode", default=defaults["mode"], choices=MODES, help="our route (default %(default)s)")
    parser.add_argument("--seed", type=int, default=defaults["seed"], help="seed of the workload and of any sampling")
    parser.add_argument("--reps", type=positive_int, default=defaults["reps"],
                        help="timed calls per path after one warm-up (default %(default)s)")
    parser.add_argument("--paths", nargs="+", default=list(defaults["paths"]), choices=paths,
                        help="paths to run, in order (default: %(default)s)")


def _add_uniform_lengths(parser: argparse.ArgumentParser, defaults: dict[str, Any], *, what: str) -> None:
    """--num-seqs, --min-len and --max-len of a bench drawing each request's ``what`` uniformly (rl, logits)."""
    parser.add_argument("--num-seqs", type=positive_int, default=defaults["num_seqs"], help="requests (default %(default)s)")
    parser.add_argument("--min-len", type=positive_int, default=defaults["min_len"],
                        help=f"smallest {what} (default %(default)s)")
    parser.add_argument("--max-len", type=positive_int, default=defaults["max_len"],
                        help=f"largest {what} (default %(default)s)")


def _add_variants(parser: argparse.ArgumentParser, defaults: dict[str, Any]) -> None:
    """--variants: the decode levers a bench compares (decode-step, logits)."""
    from rollout_lab.measure.paths import DECODE_VARIANTS  # torch: a bench's options, when it parses

    parser.add_argument("--variants", nargs="+", default=list(defaults["variants"]), choices=sorted(DECODE_VARIANTS),
                        help="decode levers to compare (default: %(default)s)")


def _read_costs(args: argparse.Namespace, *, prefill_graphs: bool | None) -> CostFile | None:
    """``--costs`` read and checked on what is known before the model is built (its name, geometry,
    dtype, device type; whether the prefill forwards are captured, unless None; none of it with
    --override-costs), so that a bad file fails before the model loads; None without --costs.
    ``_checked_costs`` checks the rest against the built model."""
    check_override_costs(args)
    if args.costs is None:
        return None
    config, name, _ = model_limits(args)
    setting = argparse.Namespace(dtype=args.dtype, device=args.device, prefill_graphs=prefill_graphs,
                                 override_costs=args.override_costs)
    return read_costs_before_work(args.costs, setting, config, name)


def _checked_costs(cost_file: CostFile | None, model: Any, name: str, *, prefill_graphs: bool | None,
                   override: bool) -> Any:
    """The coefficients of ``_read_costs``' file, checked against the built ``model`` as
    ``measure.calibrate.load_calibration`` checks them (``override``: not checked); None without one."""
    from rollout_lab.engine.model_info import model_metadata  # torch: a bench's run, when it starts

    if cost_file is None:
        return None
    return cost_file.check(model_metadata(model, model_name=name, prefill_graphs=prefill_graphs), override=override)


def _add_bench_costs(parser: argparse.ArgumentParser) -> None:
    """--costs and --override-costs, as plan and sweep have them (grpo, prefill-routes)."""
    parser.add_argument("--costs", type=cost_file_path, default=None,
                        help="a calibration (`rollout-lab calibrate`) pricing our planner (default: reference coefficients); "
                             "its provenance must match this model, dtype and device")
    parser.add_argument("--override-costs", action="store_true",
                        help="use --costs even if its provenance does not match this setting")
