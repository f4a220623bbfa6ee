"""How the planner adapts, measured (notebook 04): to long prompts (chunked prefill), to response
lengths (EOS-aware route choice) and to the machine (online recalibration). Plain rows (lists of
dicts) for tables and ``plots.adaptation``.

    from rollout_lab.measure import adaptation
    rows, plan = adaptation.chunked_prefill_rows(model, lengths=[40, 5, 3, 70], limit=16)
    rows = adaptation.eos_prior_rows(model, lengths=[...], budgets=[32, 64])      # tiny model, natural EOS
    rows = adaptation.scripted_eos_rows(...)                                      # cost model only
    rows, truth = adaptation.online_rows(model, workloads={...}, num_calls=8)

Times are wall-clock ms of whole ``Rollout.generate`` calls (one warm-up, interleaved repetitions,
the mean); on CPU only the ratios mean something.

"""
from __future__ import annotations

import random
import statistics
from contextlib import contextmanager
from typing import Any, Iterator, Mapping, Sequence

import torch

from rollout_lab.engine.api.config import RolloutConfig
from rollout_lab.engine.profile import timed_ms
from rollout_lab.engine.api.rollout import Rollout
from rollout_lab.measure.workloads import lengths_to_prompts
from rollout_lab.planner.bucket_dp import BucketPlan, plan_buckets
from rollout_lab.planner.cost import CostCoefficients, ModelGeometry
from rollout_lab.planner.decode_steps import expected_decode_steps
from rollout_lab.planner.routes import cb_decode_cost_ms, choose_route, nocb_cost_ms


@contextmanager
def forward_shapes(model: torch.nn.Module) -> Iterator[list[tuple[int, int]]]:
    """(batch, width) of every forward of ``model`` while inside (a forward pre-hook)."""
    shapes: list[tuple[int, int]] = []

    def before(module, args, kwargs):
        ids = kwargs.get("input_ids") if "input_ids" in kwargs else args[0]
        shapes.append(tuple(ids.shape))

    handle = model.register_forward_pre_hook(before, with_kwargs=True)
    try:
        yield shapes
    finally:
        handle.remove()


def timed_calls(rollouts: Mapping[str, Rollout], prompts, *, max_new_tokens: int,
                repetitions: int) -> dict[str, dict[str, Any]]:
    """Per name: mean ms over ``repetitions`` interleaved calls after one warm-up, and the last result."""
    out = {name: {"samples_ms": []} for name in rollouts}
    for rep in range(repetitions + 1):
        for name, rollout in rollouts.items():
            ms, result = timed_ms(lambda: rollout.generate(prompts, max_new_tokens=max_new_tokens,
                                                                   progress=False), rollout.device)
            if rep > 0:
                out[name]["samples_ms"].append(ms)
            out[name]["result"] = result
    for entry in out.values():
        entry["mean_ms"] = statistics.fmean(entry["samples_ms"])
    return out


# ---------------------------------------------------------------- 1: chunked prefill

def chunked_prefill_rows(
    model: torch.nn.Module, *, lengths: Sequence[int], limit: int, max_new_tokens: int = 8,
    seed: int = 0,
) -> tuple[list[dict[str, Any]], BucketPlan]:
    """bucketed and auto under ``prefill_max_tokens=limit`` against nocb without a limit: tokens,
    forwards and the most padded positions any prefill forward took."""
    vocab = model.get_input_embeddings().weight.shape[0]
    prompts = lengths_to_prompts(lengths, vocab_size=vocab, seed=seed, special_ids=[0])
    reference = Rollout(model, RolloutConfig(mode="nocb")).generate(prompts, max_new_tokens=max_new_tokens, progress=False)
    costs = CostCoefficients(prefill_max_tokens=limit)
    rows, plan = [], None
    for mode in ("bucketed", "auto"):
        rollout = Rollout(model, RolloutConfig(mode=mode, costs=costs, profile=True))
        with forward_shapes(model) as shapes:
            ms, result = timed_ms(lambda: rollout.generate(prompts, max_new_tokens=max_new_tokens,
                                                                   progress=False), rollout.device)
        prefill = [b * w for b, w in shapes if w > 1]  # decode forwards take one token per row
        plan = plan or result.plans[0]
        rows.append({
            "mode": mode, "route": result.route, "limit": limit, "lengths": ";".join(map(str, lengths)),
            "num_prefill_forwards": result.profile.num_prefill_forwards,
            "max_forward_tokens": max(prefill), "within_limit": max(prefill) <= limit,
            "matches_reference": result.sequences == reference.sequences,
            "num_chunked_prompts": len(result.plans[0].chunks), "total_ms": ms,
        })
    return rows, plan


# ---------------------------------------------------------------- 2: EOS-aware route choice

def pick_eos_tokens(
    model: torch.nn.Module, prompts, *, max_new_tokens: int, max_num_tokens: int = 8, exclude=(0,),
) -> list[int]:
    """Up to ``max_num_tokens`` EOS ids (a greedy cover) that end the greedy responses early: each
    pick lowers mean + max of the responses' first EOS most (a random tiny model has no EOS of its
    own, and one id rarely occurs early in every response)."""
    free = Rollout(model, RolloutConfig(mode="nocb")).generate(prompts, max_new_tokens=max_new_tokens, progress=False)
    first: dict[int, dict[int, int]] = {}
    for row, tokens in enumerate(free.sequences):
        for pos, token in enumerate(tokens):
            first.setdefault(token, {}).setdefault(row, pos + 1)
    chosen: list[int] = []
    ends = [max_new_tokens] * len(prompts)
    for _ in range(max_num_tokens):
        best, best_key = None, None
        for token, rows in first.items():
            if token in exclude or token in chosen:
                continue
            trial = [min(e, rows.get(r, max_new_tokens)) for r, e in enumerate(ends)]
            key = statistics.fmean(trial) + max(trial)
            if best_key is None or key < best_key:
                best, best_key = token, key
        if best is None or best_key >= statistics.fmean(ends) + max(ends):
            break
        chosen.append(best)
        ends = [min(e, first[best].get(r, max_new_tokens)) for r, e in enumerate(ends)]
    if not chosen:
        raise ValueError("the greedy responses hold no usable token; raise max_new_tokens")
    return chosen


def eos_prior_rows(
    model: torch.nn.Module, *, lengths: Sequence[int], budgets: Sequence[int], repetitions: int = 2,
    costs: CostCoefficients | None = None, seed: int = 0,
) -> list[dict[str, Any]]:
    """Natural EOS on a tiny model: reference Auto (prices the budget) vs EOS-aware Auto (the prior
    is the previous round's response lengths, on other prompts of the same lengths), both routes timed."""
    costs = costs or CostCoefficients()
    vocab = model.get_input_embeddings().weight.shape[0]
    last_round = lengths_to_prompts(lengths, vocab_size=vocab, seed=seed + 1, special_ids=[0])
    prompts = lengths_to_prompts(lengths, vocab_size=vocab, seed=seed, special_ids=[0])
    eos = pick_eos_tokens(model, last_round + prompts, max_new_tokens=max(budgets))
    rows = []
    for budget in budgets:
        base = dict(eos_token_id=eos, costs=costs)
        learner = Rollout(model, RolloutConfig(mode="auto", prior_ewma=1.0, **base))
        learner.generate(last_round, max_new_tokens=budget, progress=False)  # round k-1 gives the prior for round k
        ref = Rollout(model, RolloutConfig(mode="auto", **base))
        times = timed_calls({"nocb": Rollout(model, RolloutConfig(mode="nocb", **base)),
                             "bucketed": Rollout(model, RolloutConfig(mode="bucketed", **base))},
                            prompts, max_new_tokens=budget, repetitions=repetitions)
        ref_route = ref.generate(prompts, max_new_tokens=budget, progress=False).route
        aware_route = learner.generate(prompts, max_new_tokens=budget, progress=False).route
        responses = [len(s) for s in times["nocb"]["result"].sequences]
        best = min(("nocb", "bucketed"), key=lambda r: times[r]["mean_ms"])
        rows.append({
            "source": "tiny model, natural EOS", "eos_token_id": ";".join(map(str, eos)), "max_new_tokens": budget,
            "num_requests": len(lengths), "mean_response_length": statistics.fmean(responses),
            "max_response_length": max(responses),
            "expected_decode_steps": expected_decode_steps(learner.length_prior.current(), len(lengths), budget),
            "reference_decode_steps": budget - 1,
            "nocb_ms": times["nocb"]["mean_ms"], "bucketed_ms": times["bucketed"]["mean_ms"],
            "best_route": best, "reference_route": ref_route, "eos_aware_route": aware_route,
            "reference_e2e_ms": times[ref_route]["mean_ms"], "eos_aware_e2e_ms": times[aware_route]["mean_ms"],
            "eos_aware_vs_reference": times[aware_route]["mean_ms"] / times[ref_route]["mean_ms"],
        })
    return rows


def scripted_eos_rows(
    *, lengths: Sequence[int], budgets: Sequence[int], mean_response: float, geometry: ModelGeometry,
    costs: CostCoefficients, num_rounds: int = 200, seed: int = 0,
) -> list[dict[str, Any]]:
    """A scripted (geometric) response-length distribution priced by the cost model itself: each
    round draws lengths, the route is chosen from the previous round's lengths (EOS-aware) or from
    the budget (reference), and each route pays for the realised max length - 1 decode steps."""
    rng = random.Random(seed)
    p = 1.0 / mean_response
    rows = []
    for budget in budgets:
        draw = lambda: [min(budget, 1 + int(_geometric(rng, p))) for _ in lengths]  # noqa: E731
        previous = draw()
        paid = {"reference": 0.0, "eos_aware": 0.0, "best": 0.0}
        chosen = {"reference": set(), "eos_aware": set()}
        for _ in range(num_rounds):
            responses = draw()
            steps = max(responses) - 1
            realised = {
                "nocb": nocb_cost_ms(lengths, geometry, costs, decode_steps=steps),
                "bucketed": plan_buckets(lengths, geometry, costs).cost_ms
                + cb_decode_cost_ms(budget, costs, decode_steps=steps),
            }
            for name, prior in (("reference", None), ("eos_aware", previous)):
                route = choose_route(lengths, max_new_tokens=budget, continuous_batch_size=None,
                                     geometry=geometry, costs=costs, response_lengths=prior).route
                chosen[name].add(route)
                paid[name] += realised[route]
            paid["best"] += min(realised.values())
            previous = responses
        rows.append({
            "source": "scripted geometric lengths, cost model", "eos_token_id": None, "max_new_tokens": budget,
            "num_requests": len(lengths), "mean_response_length": mean_response,
            "reference_route": "/".join(sorted(chosen["reference"])),
            "eos_aware_route": "/".join(sorted(chosen["eos_aware"])),
            "reference_e2e_ms": paid["reference"] / num_rounds, "eos_aware_e2e_ms": paid["eos_aware"] / num_rounds,
            "best_e2e_ms": paid["best"] / num_rounds,
            "eos_aware_vs_reference": paid["eos_aware"] / paid["reference"],
        })
    return rows


def _geometric(rng: random.Random, p: float) -> int:
    """Failures before the first success, P(success) = p."""
    count = 0
    while rng.random() >= p:
        count += 1
    return count


# ---------------------------------------------------------------- 3: online recalibration

def online_rows(
    model: torch.nn.Module, *, workloads: Mapping[str, Sequence[int]], num_calls: int,
    max_new_tokens: int, repetitions: int = 2, window: int = 256, seed: int = 0,
) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """Auto from the default coefficients, with and without online recalibration, over calls that
    cycle through ``workloads``; "right" is the route measured faster (both timed per workload)."""
    vocab = model.get_input_embeddings().weight.shape[0]
    prompts = {name: lengths_to_prompts(ls, vocab_size=vocab, seed=seed + i, special_ids=[0]) for i, (name, ls) in enumerate(workloads.items())}
    truth = {}
    for name, ps in prompts.items():
        times = timed_calls({"nocb": Rollout(model, RolloutConfig(mode="nocb")),
                             "bucketed": Rollout(model, RolloutConfig(mode="bucketed"))},
                            ps, max_new_tokens=max_new_tokens, repetitions=repetitions)
        truth[name] = {"nocb_ms": times["nocb"]["mean_ms"], "bucketed_ms": times["bucketed"]["mean_ms"],
                       "right_route": min(("nocb", "bucketed"), key=lambda r: times[r]["mean_ms"])}
    online = Rollout(model, RolloutConfig(mode="auto", online_recalibration=True, online_window=window))
    defaults = Rollout(model, RolloutConfig(mode="auto"))
    names = list(workloads)
    rows = []
    for call in range(num_calls):
        name = names[call % len(names)]
        route = online.generate(prompts[name], max_new_tokens=max_new_tokens, progress=False).route
        error = online.prediction_errors[-1]
        default_route = defaults.generate(prompts[name], max_new_tokens=max_new_tokens, progress=False).route
        right = truth[name]["right_route"]
        rows.append({
            "call": call, "workload": name, "route": route, "explored": error["explored"],
            "default_route": default_route, "right_route": right,
            "is_wrong": route != right, "default_is_wrong": default_route != right,
            "predicted_prefill_ms": error["predicted_prefill_ms"], "measured_prefill_ms": error["measured_prefill_ms"],
            "prefill_rel_error": error["prefill_rel_error"], "decode_rel_error": error["decode_rel_error"],
            "rel_error": error["rel_error"],
            "fixed_cost_ms": online.costs.prefill_fixed_cost_ms,
            "continuous_decode_cost_ms": online.costs.continuous_decode_cost_ms,
            "nocb_decode_cost_ms": online.costs.nocb_decode_cost_ms,
        })
    return rows, truth
