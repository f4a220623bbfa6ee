"""Rollout inside an RL trainer: ``Rollout.generate`` alternated with a GRPO step on ONE model object.

    from rollout_lab.measure.trainer_loop import run_trainer_loop
    record = run_trainer_loop(model, model_name="qwen2.5-0.5b", dtype="bfloat16")   # 64 x 8 x 256, T=1

The workload: ``num_prompts`` random-token prompts of a dataset's lengths (``measure.workloads``), each
sampled ``num_samples`` times at temperature 1 for ``max_new_tokens`` tokens (EOS ignored), with the
rollout's logprobs (``logprobs_mode``). One warm-up call (compile and capture), then per iteration:

1. the first rollout after the previous optimizer step, then the same call again (steady): their
   difference is what a weight sync costs this engine (a trainer on vLLM reports 150-180 ms);
2. the decode graphs captured and the torch.compile frames compiled during those calls (a new
   stepper when the weights' storage changed: ``Rollout.stepper_info``; dynamo's counters);
3. a trainer step on the same batch: a toy reward (the share of even token ids), group-normalised
   advantages, ``engine.trainer.sequence_logprobs`` under autograd in ``train_rows`` micro-batches of
   the padded batch, the policy-gradient loss, AdamW;
4. |rollout logprob - trainer forward's| over every response token (mean, p50, p99, max, the share
   exactly equal): "raw" is the decode step's, "trainer" the same forward as the trainer's.

Levers: ``train_mode`` "toggle" (``model.train()`` for the step, ``eval()`` for the rollout, as an RL
user does) or "eval" throughout (the rollout is always in eval mode: ``Rollout.generate`` decodes in
eval mode whatever the model's); ``gradient_checkpointing``; ``assign`` replaces every
parameter after each step through ``load_state_dict(assign=True)`` (new storage, as a sync from
another process gives). Peak memory is the device's peak allocated during each phase (weights and
optimizer state included). ``rollout-lab bench trainer-loop`` is its command line (``--preset
qwen2.5-0.5b --train-rows 64 --out data/results/trainer_loop_qwen2.5-0.5b_bfloat16_cuda`` on the H200;
``--tiny qwen2 --num-prompts 4 --num-samples 2 --max-new-tokens 8 --scale 0.1`` is a CPU check in seconds).
"""
from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from rollout_lab.engine.runner.compiling import compile_counts
from rollout_lab.engine.api.config import MODES, RolloutConfig
from rollout_lab.engine.sample.processors import LOGPROB_MODES
from rollout_lab.engine.profile import timed_ms
from rollout_lab.engine.api.rollout import Rollout
from rollout_lab.engine.limits import ModelLimits
from rollout_lab.engine.trainer import group_advantages, policy_gradient_loss, sequence_logprobs
from rollout_lab.measure.models import special_token_ids
from rollout_lab.measure.grpo import check_group_limits, check_samples, scaled_prompt_lengths
from rollout_lab.measure.paths import check_timed_calls, timed_call
from rollout_lab.measure.provenance import provenance
from rollout_lab.measure.records import load_record
from rollout_lab.measure.sections import measure_or_load
from rollout_lab.measure.workloads import DATASETS, lengths_to_prompts
from rollout_lab.planner.checks import check_int, is_int

# the trainer step's mode: train() ("toggle", eval() again for the rollouts) or eval(); generate decodes in eval
# mode whatever the model's, so a rollout in train mode ("train", once) is no mode of this loop
TRAIN_MODES = ("toggle", "eval")
# run_trainer_loop's settings and their defaults (its signature's): the 64 prompts x 8 samples x 256 tokens
TRAINER_LOOP_DEFAULTS: dict[str, Any] = {
    "dataset": "gsm8k", "num_prompts": 64, "num_samples": 8, "max_new_tokens": 256, "scale": 1.0, "iterations": 4,
    "lr": 1e-5, "train_rows": None, "logprobs_mode": "raw", "train_mode": "toggle", "gradient_checkpointing": False,
    "assign": False, "mode": "bucketed", "seed": 0, "batch_invariant": False}
# micro-batch sizes (rows; None: the whole batch) whose trainer forwards the first iteration compares with
# the rollout's logprobs, and the rows the 1- and 8-row ones cover (a forward each)
MICRO_BATCHES: tuple[int | None, ...] = (1, 8, 64, None)
MICRO_CHECK_ROWS = 64


def check_trainer_loop_settings(*, dataset: str, num_prompts: int, num_samples: int, max_new_tokens: int,
                                scale: float, iterations: int, lr: float, train_rows: int | None, logprobs_mode: str,
                                train_mode: str, gradient_checkpointing: bool, assign: bool, mode: str,
                                seed: int, batch_invariant: bool = False, limits: ModelLimits | None = None) -> None:
    """ValueError naming the first bad setting of ``run_trainer_loop`` and what would be valid; with
    ``limits`` (the model's) the sizes too (``grpo.check_group_limits``, the trainer's logits included)."""
    if dataset not in DATASETS:
        raise ValueError(f"dataset must be one of {list(DATASETS)}, got {dataset!r}")
    for name, value in (("num_prompts", num_prompts), ("max_new_tokens", max_new_tokens)):
        check_int(value, name=name)
    check_samples(num_samples)
    check_timed_calls(iterations, name="iterations")
    if train_rows is not None and (not is_int(train_rows) or train_rows < 1):
        raise ValueError(f"train_rows must be None (every row at once) or an int >= 1, got {train_rows!r}")
    if not is_int(seed) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    for name, value in (("scale", scale), ("lr", lr)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be a number > 0, got {value!r}")
    if logprobs_mode not in LOGPROB_MODES:
        raise ValueError(f"logprobs_mode must be one of {list(LOGPROB_MODES)}, got {logprobs_mode!r}")
    check_train_mode(train_mode)
    for name, value in (("gradient_checkpointing", gradient_checkpointing), ("assign", assign),
                        ("batch_invariant", batch_invariant)):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be a bool, got {value!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")
    if batch_invariant:
        RolloutConfig(mode=mode, batch_invariant=True)  # its mode check, before any work
    lengths = scaled_prompt_lengths(dataset, num_prompts, scale=scale, seed=seed)
    if limits is not None:
        check_group_limits(limits, lengths, num_samples=num_samples, max_new_tokens=max_new_tokens, scale=scale,
                           mode=mode, trainer=True, train_rows=train_rows)


def check_train_mode(train_mode: str) -> None:
    """ValueError naming ``train_mode`` when it is not one of ``TRAIN_MODES``; "train" (rollouts in
    train mode) says why it is gone and what to give instead."""
    if train_mode == "train":
        raise ValueError("train_mode='train' ran the rollouts in train mode, which Rollout.generate no longer "
                         "does (it decodes in eval mode whatever the model's mode, restoring each module's "
                         "after the call); give 'toggle' (train() for the trainer step, eval() for the rollout) "
                         "or 'eval' (eval() throughout)")
    if train_mode not in TRAIN_MODES:
        raise ValueError(f"train_mode must be one of {list(TRAIN_MODES)}, got {train_mode!r}")


def even_token_reward(sequences: Sequence[Sequence[int]]) -> torch.Tensor:
    """[rows] the toy reward: each response's share of even token ids."""
    return torch.tensor([sum(t % 2 == 0 for t in s) / max(1, len(s)) for s in sequences])


def replace_parameters(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every parameter replaced by a copy through ``load_state_dict(assign=True)``, as a trainer
    loading synced weights does: new storage. Tied weights stay tied (one copy per storage, then
    HF's ``tie_weights``); the optimizer's state and groups move to the new parameters."""
    old = dict(model.named_parameters())
    copies: dict[int, torch.Tensor] = {}  # by storage: a tied pair gets one copy
    state = {name: copies.setdefault(t.data_ptr(), t.detach().clone()) for name, t in model.state_dict().items()}
    model.load_state_dict(state, assign=True)
    if getattr(model.config.get_text_config(decoder=True), "tie_word_embeddings", False):
        model.tie_weights()
    new = dict(model.named_parameters())
    name_of = {id(p): name for name, p in old.items()}
    for name, param in old.items():
        if param in optimizer.state:
            optimizer.state[new[name]] = optimizer.state.pop(param)
    for group in optimizer.param_groups:
        group["params"] = [new[name_of[id(p)]] for p in group["params"]]


def activation_checkpointing(model: torch.nn.Module, enabled: bool) -> None:
    """HF's gradient (activation) checkpointing on or off: ``activation_checkpointing_*`` in recent
    transformers, ``gradient_checkpointing_*`` (now a deprecated alias) before."""
    name = "activation" if hasattr(model, "activation_checkpointing_enable") else "gradient"
    if enabled:
        getattr(model, f"{name}_checkpointing_enable")(**{f"{name}_checkpointing_kwargs": {"use_reentrant": False}})
    else:
        getattr(model, f"{name}_checkpointing_disable")()


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Mapping[str, torch.Tensor],
               advantages: torch.Tensor, *, train_rows: int | None, fp32_head: bool,
               batch_invariant: bool = False) -> torch.Tensor:
    """One GRPO step over ``batch`` (``RolloutResult.to_tensors()``) in micro-batches of ``train_rows``
    rows, gradients accumulated, then AdamW; the forward's logprobs [rows, R], detached."""
    ids, mask, response_mask = batch["input_ids"], batch["attention_mask"], batch["response_mask"]
    step = train_rows or ids.shape[0]
    num_tokens = response_mask.sum()
    pieces = []
    for start in range(0, ids.shape[0], step):
        rows = slice(start, start + step)
        logprobs = sequence_logprobs(model, ids[rows], mask[rows], response_mask[rows], fp32_head=fp32_head,
                                     batch_invariant=batch_invariant)
        loss = policy_gradient_loss(logprobs, advantages[rows], response_mask[rows])
        (loss * response_mask[rows].sum() / num_tokens).backward()  # the mean over every response token
        pieces.append(logprobs.detach())
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return torch.cat(pieces)


def logprob_mismatch(rollout: torch.Tensor, trainer: torch.Tensor, response_mask: torch.Tensor) -> dict[str, float]:
    """|rollout - trainer| logprobs ([rows, R] each) over every response token: mean, p50, p99, max and
    the share exactly equal."""
    diff = (rollout - trainer).abs()[response_mask].cpu().numpy()
    return {"mean_abs": float(diff.mean()), "p50_abs": float(np.percentile(diff, 50)),
            "p99_abs": float(np.percentile(diff, 99)), "max_abs": float(diff.max()),
            "equal_share": float((diff == 0).mean())}


@torch.no_grad()
def micro_batch_mismatch(model: torch.nn.Module, batch: Mapping[str, torch.Tensor], *, fp32_head: bool,
                         batch_invariant: bool) -> dict[str, float]:
    """Max |rollout logprob - trainer forward's| over the response tokens, the forward run in eval mode
    in micro-batches of each of ``MICRO_BATCHES`` rows ("all": the whole batch); the 1- and 8-row
    ones over the first ``MICRO_CHECK_ROWS`` rows."""
    out = {}
    for size in MICRO_BATCHES:
        rows = batch["input_ids"].shape[0] if size is None or size > 8 else min(MICRO_CHECK_ROWS, batch["input_ids"].shape[0])
        step = size or rows
        pieces = [sequence_logprobs(model, batch["input_ids"][s: min(s + step, rows)],
                                    batch["attention_mask"][s: min(s + step, rows)],
                                    batch["response_mask"][s: min(s + step, rows)], fp32_head=fp32_head,
                                    batch_invariant=batch_invariant) for s in range(0, rows, step)]
        mask = batch["response_mask"][:rows]
        out["all" if size is None else str(size)] = float((torch.cat(pieces) - batch["logprobs"][:rows]).abs()[mask].max())
    return out


def decode_captures(before: Mapping[str, Any], after: Mapping[str, Any]) -> tuple[int, bool]:
    """(decode graphs captured, whether the stepper was rebuilt) between two ``Rollout.stepper_info``s.
    A rebuilt stepper (a new build: another ``build_ms``) counts every capture of its own."""
    if after.get("kind") is None:
        return 0, False
    rebuilt = before.get("kind") != after["kind"] or before.get("build_ms") != after["build_ms"]
    return after["num_captures"] - (0 if rebuilt else before["num_captures"]), rebuilt


def run_trainer_loop(
    model: Any, *, model_name: str, dtype: str, dataset: str = "gsm8k", num_prompts: int = 64, num_samples: int = 8,
    max_new_tokens: int = 256, scale: float = 1.0, iterations: int = 4, lr: float = 1e-5,
    train_rows: int | None = None, logprobs_mode: str = "raw", train_mode: str = "toggle",
    gradient_checkpointing: bool = False, assign: bool = False, mode: str = "bucketed", seed: int = 0,
    batch_invariant: bool = False, config: Mapping[str, Any] | None = None, save: Callable[[dict[str, Any]], Any] = lambda record: None,
    progress: Callable[[str], Any] = lambda line: print(line, file=sys.stderr), **prov: Any,
) -> dict[str, Any]:
    """The loop of the module docstring on ``model`` (built, on its device; its weights are trained);
    the record (kind "trainer_loop"). ``save(record)`` runs after every iteration, so a later failure
    loses nothing. ``config`` adds to the record's settings; ``prov`` to its provenance. Bad settings are
    a ValueError before any work."""
    settings = {"dataset": dataset, "num_prompts": num_prompts, "num_samples": num_samples,
                "max_new_tokens": max_new_tokens, "scale": scale, "iterations": iterations, "lr": lr,
                "train_rows": train_rows, "logprobs_mode": logprobs_mode, "train_mode": train_mode,
                "gradient_checkpointing": gradient_checkpointing, "assign": assign, "mode": mode, "seed": seed,
                "batch_invariant": batch_invariant}
    check_trainer_loop_settings(**settings, limits=ModelLimits.of_model(model))
    device = next(model.parameters()).device
    cfg = model.config.get_text_config(decoder=True)
    vocab = model.get_input_embeddings().weight.shape[0]
    pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    lengths = scaled_prompt_lengths(dataset, num_prompts, scale=scale, seed=seed)
    prompts = lengths_to_prompts(lengths, vocab_size=vocab, seed=seed, special_ids=special_token_ids(cfg))
    iterations_out: list[dict[str, Any]] = []
    record = {
        "kind": "trainer_loop",
        "provenance": provenance(device=device, dtype=dtype, **prov),
        "config": settings | {"dtype": dtype} | dict(config or {}) | {"model": model_name},
        "workload": {"lengths": lengths, "num_rows": num_prompts * num_samples,
                     "num_generated_tokens": num_prompts * num_samples * max_new_tokens},
        "results": {"iterations": iterations_out},
    }
    if gradient_checkpointing:
        activation_checkpointing(model, True)
    model.eval()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    rollout = Rollout(model, RolloutConfig(mode=mode, ignore_eos=True, pad_token_id=pad_id, batch_invariant=batch_invariant))
    fp32_head = logprobs_mode == "trainer_fp32"

    def generate(iteration: int):
        return rollout.generate(prompts, max_new_tokens=max_new_tokens, num_samples=num_samples, do_sample=True,
                                temperature=1.0, seed=seed + iteration, return_logprobs=True,
                                logprobs_mode=logprobs_mode, progress=False)

    record["results"]["first_call_ms"], _ = timed_ms(lambda: generate(0), device)  # compile and capture
    progress(f"warm-up {record['results']['first_call_ms']:10.1f} ms (compile and capture included)")
    try:
        for iteration in range(iterations):
            model.eval()  # as an RL user does before a rollout (generate would switch it for the call)
            info, counts = rollout.stepper_info, compile_counts()
            first_ms, result, peak_rollout = timed_call(lambda: generate(iteration), device)
            after_info, after_first = rollout.stepper_info, compile_counts()
            captures, rebuilt = decode_captures(info, after_info)
            steady_ms, steady, _ = timed_call(lambda: generate(iteration), device)
            steady_captures, _ = decode_captures(after_info, rollout.stepper_info)
            batch = result.to_tensors(device=device)
            micro = micro_batch_mismatch(model, batch, fp32_head=fp32_head, batch_invariant=batch_invariant) \
                if iteration == 0 else None  # before the step changes the weights
            model.train(train_mode == "toggle")  # the trainer step's mode
            rewards = even_token_reward(result.sequences)
            advantages = group_advantages(rewards, num_samples=num_samples).to(device)
            train_ms, trainer_logprobs, peak_train = timed_call(lambda: train_step(
                model, optimizer, batch, advantages, train_rows=train_rows, fp32_head=fp32_head,
                batch_invariant=batch_invariant), device)
            assign_ms = timed_ms(lambda: replace_parameters(model, optimizer), device)[0] if assign else None
            final = compile_counts()
            out = {
                "iteration": iteration, "first_rollout_ms": first_ms, "steady_rollout_ms": steady_ms,
                "sync_ms": first_ms - steady_ms, "train_ms": train_ms, "assign_ms": assign_ms,
                "decode_captures": captures, "stepper_rebuilt": rebuilt, "steady_decode_captures": steady_captures,
                "compiled_frames": after_first["frames"] - counts["frames"],
                "compiled_graphs": after_first["graphs"] - counts["graphs"],
                "steady_compiled_frames": final["frames"] - after_first["frames"],
                "steady_same_tokens": steady.sequences == result.sequences,
                "mean_reward": float(rewards.mean()), "route": result.route,
                "peak_rollout_bytes": peak_rollout, "peak_train_bytes": peak_train,
                "logprob_mismatch": logprob_mismatch(batch["logprobs"], trainer_logprobs, batch["response_mask"]),
                "micro_batch_max_abs": micro,
            }
            iterations_out.append(out)
            save(record)
            mismatch = out["logprob_mismatch"]
            progress(f"iteration {iteration}: rollout {first_ms:8.1f} ms (steady {steady_ms:8.1f}, sync "
                     f"{out['sync_ms']:+7.1f})  train {train_ms:8.1f} ms  captures {captures}  frames "
                     f"{out['compiled_frames']}  |dlogp| mean {mismatch['mean_abs']:.2e} max {mismatch['max_abs']:.2e}")
    finally:
        rollout.close()
        model.eval()
        if gradient_checkpointing:
            activation_checkpointing(model, False)
    record["results"]["stepper"] = rollout.stepper_info
    return record


def trainer_loop_rows(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per iteration of a trainer-loop record: rollout, sync and train ms, captures, compiled
    frames, the logprob mismatch, the reward and peak memory; ``git_sha`` (7 characters) names the code."""
    sha = str(record.get("provenance", {}).get("git_sha") or "")[:7]
    rows = []
    for it in record["results"]["iterations"]:
        mismatch = it["logprob_mismatch"]
        rows.append({"iteration": it["iteration"], "git_sha": sha, "first_rollout_ms": it["first_rollout_ms"],
                     "steady_rollout_ms": it["steady_rollout_ms"], "sync_ms": it["sync_ms"], "train_ms": it["train_ms"],
                     "assign_ms": it["assign_ms"], "decode_captures": it["decode_captures"],
                     "stepper_rebuilt": it["stepper_rebuilt"], "compiled_frames": it["compiled_frames"],
                     "logprob_mean_abs": mismatch["mean_abs"], "logprob_max_abs": mismatch["max_abs"],
                     "logprob_equal_share": mismatch["equal_share"], "mean_reward": it["mean_reward"],
                     **{f"peak_{phase}_gb": None if it[f"peak_{phase}_bytes"] is None else it[f"peak_{phase}_bytes"] / 1e9
                        for phase in ("rollout", "train")}})
    return rows


def trainer_loop_or_load(
    *, trainer_loop_shape: Mapping[str, Any] | None, trainer_loop_results_file: str | None, model: str, dtype: str,
    device: str, output_dir: Any = None,
) -> tuple[str, dict[str, Any]] | None:
    """(name, record) of the trainer loop notebook 03 shows: ``trainer_loop_shape`` (``run_trainer_loop``'s
    settings, ``TRAINER_LOOP_DEFAULTS`` where it says nothing) measured on ``model`` into
    ``<workspace>/data/results/trainer_loop_<model>_<dtype>_<device>`` (written after every iteration),
    else the saved record ``trainer_loop_results_file``, else None (``sections.measure_or_load``: giving
    both, bad settings and a record in the way are errors raised before the model is built)."""
    def run(net, name, shape, save, script):
        return run_trainer_loop(net, model_name=name, dtype=dtype, save=save, script=script, **shape)

    return measure_or_load("trainer_loop", shape=trainer_loop_shape, results_file=trainer_loop_results_file,
                           kind="trainer_loop", defaults=TRAINER_LOOP_DEFAULTS,
                           check=lambda shape, limits: check_trainer_loop_settings(**shape, limits=limits), run=run,
                           rows=trainer_loop_rows, model=model, dtype=dtype, device=device, output_dir=output_dir)


# the settings two trainer-loop records must share for their rollouts' costs to be compared (the card too)
SAME_WORKLOAD = ("model", "dtype", "dataset", "num_prompts", "num_samples", "max_new_tokens", "scale", "seed")


def load_logprob_mode_records(files: Mapping[str, str | Path]) -> dict[str, dict[str, Any]]:
    """{mode name: trainer-loop record} read from ``files`` ({mode name: record path}, in the order
    drawn; the first is the cost baseline). ValueError naming the mode and the path when a file is
    not a trainer-loop record (``records.load_record``)."""
    if not isinstance(files, Mapping) or not files:
        raise ValueError(f"expected a non-empty dict of {{mode name: trainer-loop record path}}, got {files!r}")
    records = {}
    for name, path in files.items():
        try:
            records[str(name)] = load_record(Path(path), "trainer_loop")
        except (OSError, ValueError) as err:
            raise ValueError(f"logprobs mode {name!r}: {err}") from None
    return records


def logprob_mode_rows(records: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per named trainer-loop record ({mode name: record}, e.g. the default "raw" logprobs,
    the trainer's recompute, the batch-invariant decode): its steady rollout and train ms (means over
    the iterations), |rollout - trainer| logprob (the worst iteration's max; the mean over iterations
    of the mean, p50, p99 and equal share), the first iteration's micro-batch maxima (``micro_1``,
    ``micro_8``, ``micro_64``, ``micro_all``; None in records written before they were measured) and
    the steady rollout over the first record's. ValueError when the records ran other workloads
    (``SAME_WORKLOAD``) or on other cards, whose costs do not compare."""
    if not isinstance(records, Mapping) or not records:
        raise ValueError(f"expected a non-empty dict of {{mode name: trainer-loop record}}, got {records!r}")
    (first_name, first), *_ = records.items()
    rows = []
    for name, record in records.items():
        if not isinstance(record, Mapping) or record.get("kind") != "trainer_loop":
            raise ValueError(f"mode {name!r} is not a trainer_loop record (kind "
                             f"{record.get('kind') if isinstance(record, Mapping) else type(record).__name__!r})")
        cfg, prov = record["config"], record.get("provenance", {})
        for key in SAME_WORKLOAD:
            if cfg.get(key) != first["config"].get(key):
                raise ValueError(f"mode {name!r} ran {key}={cfg.get(key)!r}, mode {first_name!r} "
                                 f"{first['config'].get(key)!r}: their costs do not compare; give records of one workload")
        if prov.get("device_name") != first.get("provenance", {}).get("device_name"):
            raise ValueError(f"mode {name!r} ran on {prov.get('device_name')!r}, mode {first_name!r} on "
                             f"{first.get('provenance', {}).get('device_name')!r}: give records of one card")
        its = record["results"]["iterations"]
        if not its:
            raise ValueError(f"mode {name!r}: the record has no iterations")
        mismatch = [it["logprob_mismatch"] for it in its]
        micro = its[0].get("micro_batch_max_abs") or {}
        rows.append({
            "mode": str(name), "git_sha": str(prov.get("git_sha") or "")[:7],
            "logprobs_mode": cfg["logprobs_mode"], "batch_invariant": bool(cfg.get("batch_invariant")),
            "route": cfg["mode"], "iterations": len(its),
            "steady_rollout_ms": float(np.mean([it["steady_rollout_ms"] for it in its])),
            "train_ms": float(np.mean([it["train_ms"] for it in its])),
            **{key: float(np.mean([m[key] for m in mismatch])) for key in ("mean_abs", "p50_abs", "p99_abs")},
            "max_abs": max(m["max_abs"] for m in mismatch),
            "equal_share": float(np.mean([m["equal_share"] for m in mismatch])),
            **{f"micro_{size or 'all'}": micro.get(str(size or "all")) for size in MICRO_BATCHES},
        })
    for row in rows:
        row["rollout_vs_first"] = row["steady_rollout_ms"] / rows[0]["steady_rollout_ms"]
    return rows
