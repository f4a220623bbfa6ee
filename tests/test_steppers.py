"""The decode steppers: eager on CPU (reuse, release), CUDA-graph replay equal to eager (CUDA only)."""
from __future__ import annotations

import random

import pytest
import torch
from conftest import get_tiny

from rollout_lab import Rollout, RolloutConfig
from rollout_lab.engine.runner.steppers import graph_weights, rebind_weights, resolve_decode_mode
from rollout_lab.measure.models import TINY_VOCAB_SIZE, tiny_model
from rollout_lab.planner.cost import CostCoefficients

SPLIT = CostCoefficients(prefill_fixed_cost_ms=0.05, continuous_decode_cost_ms=0.0)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")


def prompts_of(lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(1, TINY_VOCAB_SIZE) for _ in range(n)] for n in lengths]


def test_decode_mode_is_chosen_from_the_device():
    assert resolve_decode_mode("auto", "cpu") == "eager"
    assert resolve_decode_mode("eager", "cpu") == "eager"
    with pytest.raises(ValueError, match="decode='graph' needs a CUDA device"):
        resolve_decode_mode("graph", "cpu")
    with pytest.raises(ValueError, match="decode must be one of"):
        RolloutConfig(decode="fast")


def test_eager_stepper_is_kept_across_calls_and_released():
    model = get_tiny("qwen2")
    prompts = prompts_of([9, 3, 3, 5])
    with Rollout(model, RolloutConfig(mode="bucketed", costs=SPLIT)) as rollout:
        first = rollout.generate(prompts, max_new_tokens=4).sequences
        stepper = rollout.runner.stepper
        assert rollout.stepper_info["kind"] == "eager"
        again = rollout.generate(prompts, max_new_tokens=4).sequences
        assert rollout.runner.stepper is stepper and again == first
        rollout.generate(prompts[:2], max_new_tokens=4)  # fewer slots: a new stepper
        assert rollout.runner.stepper is not stepper
    assert rollout.runner.stepper is None
    assert rollout.generate(prompts, max_new_tokens=4).sequences == first  # usable after close


@pytest.mark.parametrize("mode", ["bucketed", "packed"])
def test_a_prefill_only_call_builds_no_stepper_and_keeps_the_kept_one(mode):
    """Budgets of 1 take every token from the prefill: no decode stepper is built (on CUDA that
    would compile and capture a step that never runs), and the one kept from earlier calls stays."""
    model = get_tiny("qwen2")
    prompts = prompts_of([9, 3, 3, 5], seed=4)
    with Rollout(model, RolloutConfig(mode=mode, costs=SPLIT)) as rollout:
        first = rollout.generate(prompts, max_new_tokens=1).sequences
        assert rollout.stepper_info["kind"] is None
        longer = rollout.generate(prompts, max_new_tokens=4).sequences
        assert first == [s[:1] for s in longer]
        stepper = rollout.runner.stepper
        assert stepper is not None
        assert rollout.generate(prompts, max_new_tokens=[1, 1, 1, 1]).sequences == first
        assert rollout.runner.stepper is stepper
        assert rollout.generate(prompts, max_new_tokens=4).sequences == longer


def _cuda_model(family, dtype=torch.float32, seed=0):
    return tiny_model(family, seed=seed, dtype=dtype).to("cuda")


@cuda
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama", "opt"])
def test_graph_equals_eager_and_oracle(family, oracle):
    model = _cuda_model(family)
    cpu_model = get_tiny(family)
    lengths = [17, 1, 9, 30, 3, 3, 22, 6]
    prompts = prompts_of(lengths, seed=3)
    expected = oracle(cpu_model, prompts, max_new_tokens=6)
    for mode in ("equal_width", "aligned", "bucketed", "auto"):
        for slots in (None, 3):
            config = RolloutConfig(mode=mode, costs=SPLIT, continuous_batch_size=slots, decode="graph")
            with Rollout(model, config) as rollout:
                result = rollout.generate(prompts, max_new_tokens=6)
                assert rollout.stepper_info["kind"] == "graph"
                assert rollout.stepper_info["num_replays"] > 0
            assert result.sequences == expected, (family, mode, slots)


@cuda
def test_graph_with_eos_penalty_and_refill_equals_eager():
    model = _cuda_model("qwen2")
    prompts = prompts_of([5, 12, 3, 8, 20, 2, 7, 9, 4], seed=5)
    eager_tokens = Rollout(model, RolloutConfig(mode="bucketed", costs=SPLIT, decode="eager")) \
        .generate(prompts, max_new_tokens=12).sequences
    eos = max(set(t for s in eager_tokens for t in s[1:4]), key=lambda t: sum(s.count(t) for s in eager_tokens))
    for penalty in (1.0, 1.3):
        kwargs = dict(mode="bucketed", costs=SPLIT, continuous_batch_size=4, eos_token_id=eos,
                      repetition_penalty=penalty)
        eager = Rollout(model, RolloutConfig(decode="eager", **kwargs)).generate(prompts, max_new_tokens=12)
        with Rollout(model, RolloutConfig(decode="graph", **kwargs)) as rollout:  # release the graph
            graph = rollout.generate(prompts, max_new_tokens=12)
        assert graph.sequences == eager.sequences
    assert any(len(s) < 12 for s in eager.sequences)  # EOS really retired rows early


def _assign(model, source):
    """A trainer's weight sync into new tensors: every parameter and buffer replaced."""
    model.load_state_dict({k: v.detach().clone() for k, v in source.state_dict().items()}, assign=True)


def test_replaced_weights_are_copied_back_into_the_captured_memory():
    model, other = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    captured = graph_weights(model)
    _assign(model, other)
    replaced = list(model.parameters())
    assert any(p.data_ptr() != c.data_ptr() for p, c in zip(replaced, captured))
    assert rebind_weights(model, captured)
    assert [t.data_ptr() for t in (*model.parameters(), *model.buffers())] == [c.data_ptr() for c in captured]
    assert all(a is b for a, b in zip(model.parameters(), replaced))  # an optimizer's parameters stay its own
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), other.parameters()))
    assert rebind_weights(model, captured)  # nothing moved: nothing to do
    head = model.get_output_embeddings()  # the same values in another layout: not rebound, nothing changed
    head.weight = torch.nn.Parameter(head.weight.detach().t().contiguous().t())
    before = [p.data_ptr() for p in model.parameters()]
    assert not rebind_weights(model, captured)
    assert [p.data_ptr() for p in model.parameters()] == before


def test_a_call_after_a_weight_sync_runs_the_new_weights_in_the_kept_memory():
    """What a CUDA rollout does at the start of a call when its graphs' weights were replaced, run on
    the CPU by giving the rollout the captured weights that CUDA's first capture would note."""
    model, other = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    prompts = prompts_of([6, 6, 2, 11], seed=9)
    expected = Rollout(other, RolloutConfig(mode="bucketed", costs=SPLIT)).generate(prompts, max_new_tokens=5)
    rollout = Rollout(model, RolloutConfig(mode="bucketed", costs=SPLIT))
    first = rollout.generate(prompts, max_new_tokens=5)
    rollout.runner.graph_weights = captured = graph_weights(model)
    _assign(model, other)
    assert rollout.generate(prompts, max_new_tokens=5).sequences == expected.sequences != first.sequences
    assert rollout.runner.graph_weights is captured
    assert [t.data_ptr() for t in (*model.parameters(), *model.buffers())] == [c.data_ptr() for c in captured]


@cuda
def test_one_capture_serves_calls_and_weight_replacement_recaptures():
    model = _cuda_model("llama")
    prompts = prompts_of([6, 6, 2, 11], seed=9)
    with Rollout(model, RolloutConfig(mode="bucketed", costs=SPLIT, decode="graph")) as rollout:
        first = rollout.generate(prompts, max_new_tokens=5).sequences
        second = rollout.generate(prompts_of([7, 3, 3, 9], seed=1), max_new_tokens=5).sequences
        assert rollout.stepper_info["num_captures"] == 1
        with torch.no_grad():  # in-place update: same storage, the graph reads the new values
            for p in model.parameters():
                p.mul_(1.0)
        assert rollout.generate(prompts, max_new_tokens=5).sequences == first
        assert rollout.stepper_info["num_captures"] == 1
        stepper = rollout.runner.stepper
        _assign(model, _cuda_model("llama", seed=1))  # new storage, same layout: copied in, not recaptured
        synced = rollout.generate(prompts, max_new_tokens=5).sequences
        assert rollout.runner.stepper is stepper and rollout.stepper_info["num_captures"] == 1
        fresh = Rollout(_cuda_model("llama", seed=1), RolloutConfig(mode="bucketed", costs=SPLIT, decode="eager"))
        assert synced == fresh.generate(prompts, max_new_tokens=5).sequences != first
        head = model.get_output_embeddings()  # another layout (strides): recapture
        head.weight = torch.nn.Parameter(head.weight.detach().t().contiguous().t())
        assert rollout.generate(prompts, max_new_tokens=5).sequences == synced
        assert rollout.runner.stepper is not stepper
    assert second and rollout.runner.stepper is None


@cuda
@pytest.mark.parametrize("family", ["qwen2", "opt"])
def test_graph_sampling_equals_eager_sampling(family):
    model = _cuda_model(family)
    prompts = prompts_of([5, 12, 3, 8, 20, 2, 7], seed=4)
    prompts[3] = list(prompts[1])  # a repeated request: shared prefill
    gen = dict(num_samples=3, do_sample=True, temperature=0.8, top_k=50, top_p=0.9, seed=17)
    for penalty in (1.0, 1.3):
        kwargs = dict(mode="bucketed", costs=SPLIT, continuous_batch_size=5, repetition_penalty=penalty)
        eager = Rollout(model, RolloutConfig(decode="eager", **kwargs)).generate(prompts, max_new_tokens=10, **gen)
        with Rollout(model, RolloutConfig(decode="graph", **kwargs)) as rollout:
            graph = rollout.generate(prompts, max_new_tokens=10, **gen)
            assert rollout.stepper_info["kind"] == "graph" and rollout.stepper_info["num_replays"] > 0
            assert rollout.runner.stepper.key.do_sample
        assert graph.sequences == eager.sequences, penalty
        nocb = Rollout(model, RolloutConfig(mode="nocb", costs=SPLIT, repetition_penalty=penalty)) \
            .generate(prompts, max_new_tokens=10, **gen)
        assert nocb.sequences == eager.sequences, penalty


@cuda
def test_graph_per_request_sampling_and_min_new_tokens_equal_eager():
    """Rows of different settings (a greedy one among them) and of different min_new_tokens share one
    captured (compiled) step and draw eager's tokens, on the aligned and the paged cache."""
    from rollout_lab.engine.sample.params import SamplingParams

    model = _cuda_model("qwen2")
    prompts = prompts_of([5, 12, 3, 8], seed=4)
    params = [SamplingParams(0.8, 50, 0.9, seed=1), SamplingParams(0), SamplingParams(1.2, 5), SamplingParams(top_p=0.7)]
    gen = dict(num_samples=2, sampling=params, seed=5, max_new_tokens=12)
    free = Rollout(model, RolloutConfig(mode="bucketed", costs=SPLIT, decode="eager")).generate(prompts, **gen)
    eos = max(set(t for s in free.sequences for t in s[:4]), key=lambda t: sum(t in s[:6] for s in free.sequences))
    gen["min_new_tokens"] = [4, 6, 0, 3]
    eager = Rollout(model, RolloutConfig(mode="bucketed", costs=SPLIT, decode="eager", eos_token_id=eos)) \
        .generate(prompts, **gen)
    for mode in ("bucketed", "paged"):
        with Rollout(model, RolloutConfig(mode=mode, costs=SPLIT, decode="graph", eos_token_id=eos,
                                          continuous_batch_size=5)) as rollout:
            graph = rollout.generate(prompts, **gen)
            assert rollout.runner.stepper.key.min_new_tokens and rollout.runner.stepper.key.do_sample
        assert graph.sequences == eager.sequences, mode


@cuda
def test_graph_vllm_sampling_fields_per_request_equal_eager():
    """vLLM's per-request fields (penalties of both signs, min-p, n, max/min_tokens, stop ids) in one
    captured (compiled) step: eager's tokens on the aligned and the paged cache."""
    from rollout_lab.engine.sample.params import SamplingParams

    model = _cuda_model("qwen2")
    prompts = prompts_of([5, 12, 3, 8], seed=6)
    params = [SamplingParams(0.0, presence_penalty=1.5, frequency_penalty=0.5, n=2),
              SamplingParams(0.9, 40, min_p=0.05, frequency_penalty=-0.75, seed=3, n=3, max_tokens=9),
              SamplingParams(1.3, top_p=0.9, repetition_penalty=1.5, seed=8, min_tokens=4, stop_token_ids=[7, 9]),
              SamplingParams(0.7, min_p=0.2, seed=11, max_tokens=5)]
    gen = dict(sampling=params, seed=5, max_new_tokens=16)
    eager = Rollout(model, RolloutConfig(mode="bucketed", costs=SPLIT, decode="eager")).generate(prompts, **gen)
    for mode in ("bucketed", "paged"):
        with Rollout(model, RolloutConfig(mode=mode, costs=SPLIT, decode="graph", continuous_batch_size=5)) as rollout:
            graph = rollout.generate(prompts, **gen)
            key = rollout.runner.stepper.key
            assert key.track_seen and key.track_counts and key.min_p_filter and key.min_new_tokens
        assert graph.sequences == eager.sequences, mode


def test_graph_ladder_rungs():
    from rollout_lab.engine.runner.steppers import graph_ladder

    assert graph_ladder(256, 24) == (1, 2, 4, 8, *range(16, 257, 16))
    assert graph_ladder(256, 1) == (256,)
    assert graph_ladder(256, 24, smallest=2) == (2, 4, 8, *range(16, 257, 16))  # compiled: no 1-row rung
    assert graph_ladder(1, 5, smallest=2) == (1,) and graph_ladder(2, 5, smallest=2) == (2,)
    assert graph_ladder(3, 24) == (1, 2, 3) and graph_ladder(1, 5) == (1,) and graph_ladder(17, 24)[-2:] == (16, 17)
    thinned = graph_ladder(256, 8)
    assert len(thinned) == 8 and thinned[-1] == 256 and list(thinned) == sorted(set(thinned))
    with pytest.raises(ValueError, match="max_graphs must be >= 1"):
        graph_ladder(4, 0)
    with pytest.raises(ValueError, match="max_decode_graphs must be an int >= 1"):
        RolloutConfig(max_decode_graphs=0)


@cuda
def test_graph_ladder_with_budgets_refill_and_eos_equals_eager():
    """The laddered graphs (a smaller graph as rows retire) give eager's tokens, fp32, with
    per-request budgets, refill and EOS; the one-graph stepper too."""
    model = _cuda_model("qwen3")
    prompts = prompts_of([5, 12, 3, 8, 20, 2, 7, 9, 4, 15, 6, 1, 11, 3, 9, 2, 18], seed=8)
    budgets = [3, 17, 9, 1, 25, 6, 12, 4, 30, 2, 8, 14, 5, 21, 7, 10, 3]
    eager_tokens = Rollout(model, RolloutConfig(mode="bucketed", costs=SPLIT, decode="eager")) \
        .generate(prompts, max_new_tokens=budgets).sequences
    eos = max(set(t for s in eager_tokens for t in s[1:4]), key=lambda t: sum(s.count(t) for s in eager_tokens))
    for slots in (None, 6):
        kwargs = dict(mode="bucketed", costs=SPLIT, continuous_batch_size=slots, eos_token_id=eos)
        eager = Rollout(model, RolloutConfig(decode="eager", **kwargs)).generate(prompts, max_new_tokens=budgets)
        for graphs in (24, 1):
            config = RolloutConfig(decode="graph", max_decode_graphs=graphs, decode_attention="masked",
                                   compile=False, **kwargs)  # windows are a masked-attention ladder
            with Rollout(model, config) as rollout:
                graph = rollout.generate(prompts, max_new_tokens=budgets)
                info = rollout.stepper_info
            assert graph.sequences == eager.sequences, (slots, graphs)
            if graphs == 1:
                assert set(info["replays_by_rows"]) == {info["num_slots"]}  # one row count
                assert info["num_graphs"] == len(info["widths"])  # times the attention windows
            else:
                assert len(info["replays_by_rows"]) > 1, info  # smaller graphs ran as rows retired
                assert len(info["replays_by_width"]) > 1, info  # and narrower attention windows


def test_width_ladder_and_windows_change_no_token(monkeypatch):
    from rollout_lab.engine.runner import steppers
    from rollout_lab.engine.runner.steppers import width_ladder

    assert width_ladder(2048, 4) == (512, 1024, 1536, 2048) and width_ladder(64, 1) == (64,)
    assert width_ladder(40, 4) == (16, 32, 40) and width_ladder(10, 4) == (10,)
    with pytest.raises(ValueError, match="num_widths must be >= 1"):
        width_ladder(64, 0)
    with pytest.raises(ValueError, match="decode_widths must be an int >= 1"):
        RolloutConfig(decode_widths=0)
    seen = []
    real = steppers.decode_step
    monkeypatch.setattr(steppers, "decode_step", lambda *a, **k: seen.append(k["width"]) or real(*a, **k))
    model = get_tiny("llama")
    prompts = prompts_of([3, 14, 6, 2, 9], seed=12)
    budgets = [20, 4, 30, 11, 7]
    whole = Rollout(model, RolloutConfig(mode="bucketed", costs=SPLIT, decode_widths=1)).generate(
        prompts, max_new_tokens=budgets).sequences
    assert set(seen) == {14 + 30}  # one window: the capacity (longest prompt + largest budget)
    seen.clear()
    windowed = Rollout(model, RolloutConfig(mode="bucketed", costs=SPLIT, decode_widths=4)).generate(
        prompts, max_new_tokens=budgets).sequences
    assert windowed == whole
    assert seen == sorted(seen) and seen[0] < seen[-1] == 44 and len(set(seen)) == 3, seen


@cuda
@pytest.mark.parametrize("mode", ["bucketed", "paged"])
def test_the_fused_graph_step_draws_eagers_tokens_and_follows_weight_updates(mode):
    """fuse_projections on the captured, compiled step (fp32): eager's tokens, greedy and sampled;
    after an in-place update and parameters replaced by new tensors, the kept step (no recapture)
    still draws what an eager rollout of the updated model draws."""
    model = _cuda_model("qwen2", seed=2)
    prompts = prompts_of([5, 12, 3, 8, 20, 2, 7], seed=6)
    gen = dict(max_new_tokens=9, do_sample=True, temperature=0.9, top_k=40, seed=3)
    kwargs = dict(mode=mode, costs=SPLIT, continuous_batch_size=4)
    with Rollout(model, RolloutConfig(decode="graph", fuse_projections="auto", **kwargs)) as rollout:
        assert rollout.runner.fused
        stepper = None
        for update in range(3):
            if update == 1:
                with torch.no_grad():
                    model.model.layers[0].mlp.up_proj.weight.mul_(1.1)  # an optimizer's in-place step
            if update == 2:
                state = {k: v.clone() for k, v in model.state_dict().items()}
                state["model.layers.1.self_attn.v_proj.bias"] += 0.1
                model.load_state_dict(state, assign=True)  # a weight sync into new tensors
            eager = Rollout(model, RolloutConfig(decode="eager", **kwargs)).generate(prompts, **gen)
            graph = rollout.generate(prompts, **gen)
            stepper = stepper or rollout.runner.stepper
            assert rollout.runner.stepper is stepper and rollout.stepper_info["fused"]  # refreshed, not recaptured
            assert graph.sequences == eager.sequences, update


@cuda
@pytest.mark.parametrize("mode", ["bucketed", "paged"])
def test_the_layer_wise_compiled_graph_step_draws_eagers_tokens_with_one_trace(mode):
    """compile="layers" on the captured step (fp32, inductor, fused projections by default): eager's
    tokens, sampled, on the aligned and the paged cache; and as many dynamo graphs for eight decoder
    layers as for two (each layer is given its own cache layer, engine.runner.compiling), not one per layer.
    The count itself is several: one per captured row count that specialises, and the token choice's."""
    from transformers import AutoModelForCausalLM

    from rollout_lab.measure.models import tiny_config

    prompts = prompts_of([5, 12, 3, 8, 20, 2, 7], seed=6)
    gen = dict(max_new_tokens=9, do_sample=True, temperature=0.9, top_k=40, seed=3)
    kwargs = dict(mode=mode, costs=SPLIT, continuous_batch_size=4)
    graphs = {}
    for depth in (2, 8):
        torch.manual_seed(2)
        model = AutoModelForCausalLM.from_config(tiny_config("qwen2", num_layers=depth)).eval().to("cuda")
        eager = Rollout(model, RolloutConfig(decode="eager", **kwargs)).generate(prompts, **gen)
        torch._dynamo.reset()
        with Rollout(model, RolloutConfig(decode="graph", prefill_graphs=False, **kwargs)) as rollout:
            before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            graph = rollout.generate(prompts, **gen)
            assert rollout.stepper_info["compiled"] == "layers"  # compile="auto"'s choice for a layer list
            graphs[depth] = torch._dynamo.utils.counters["stats"]["unique_graphs"] - before
        assert graph.sequences == eager.sequences, depth
    assert 0 < graphs[8] == graphs[2], graphs  # one trace per layer gave 8 + 2 more at every shape
