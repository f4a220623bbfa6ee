"""engine.runner.compiling: the forward compiled whole or layer by layer, on the CPU with the aot_eager
backend (inductor's code generation is the GPU tests' business; this checks what is compiled)."""
from __future__ import annotations

import pytest
import torch
from conftest import get_tiny

from rollout_lab.cli.main import main
from rollout_lab.engine.runner.compiling import compile_forward, decoder_layers
from rollout_lab.engine.runner.prefill import cache_kwarg_name


@pytest.mark.parametrize("family, name", [("qwen2", "model.layers"), ("qwen3", "model.layers"),
                                          ("llama", "model.layers"), ("opt", "model.decoder.layers")])
def test_decoder_layers_finds_each_familys_layer_list(family, name):
    assert decoder_layers(get_tiny(family)) == name


def test_a_model_without_a_layer_list_is_refused():
    with pytest.raises(ValueError, match="no list of decoder layers"):
        decoder_layers(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"compile mode must be one of \['model', 'layers'\], got 'blocks'"):
        compile_forward(torch.nn.Linear(2, 2), "blocks")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "opt"])
def test_layerwise_forward_equals_the_model_and_leaves_it_alone(family):
    torch._dynamo.reset()
    model = get_tiny(family)
    ids = torch.randint(3, 100, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        forward = compile_forward(model, "layers", backend="aot_eager")
        got = forward(input_ids=ids).logits
    assert torch.equal(got, want)
    name = decoder_layers(model)
    originals, compiled = model.get_submodule(name), forward.get_submodule(name)
    assert all(type(layer) is not torch._dynamo.eval_frame.OptimizedModule for layer in originals)
    assert all(isinstance(layer.compiled, torch._dynamo.eval_frame.OptimizedModule) for layer in compiled)
    assert all(c.compiled._orig_mod is o for c, o in zip(compiled, originals))  # the same layers, not copies
    assert forward.get_output_embeddings() is model.get_output_embeddings()
    assert torch._dynamo.config.recompile_limit >= 8 * len(originals)
    assert torch._dynamo.config.accumulated_recompile_limit >= 16 * len(originals)


def test_sweep_compile_layers_is_checked_before_the_model(tmp_path, capsys):
    argv = ["sweep", "--tiny", "qwen2", "--device", "cpu", "--workloads", "short_tail", "--out", str(tmp_path / "s")]
    assert main([*argv, "--compile-layers"]) == 2
    assert "--compile-layers compiles the CUDA-graph decode step; --device is cpu" in capsys.readouterr().err
    assert main([*argv, "--compile-layers", "--no-compile"]) == 2
    assert "--no-compile and --compile-layers contradict each other" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_layerwise_prefill_into_a_dynamic_cache_equals_the_model():
    """What the prefill graphs run: a forward that fills a fresh DynamicCache, layer by layer."""
    from transformers import DynamicCache

    torch._dynamo.reset()
    model = get_tiny("qwen3")
    ids = torch.randint(3, 100, (3, 9), generator=torch.Generator().manual_seed(2))
    forward = compile_forward(model, "layers", backend="aot_eager")
    kwarg = cache_kwarg_name(model)  # past_key_values or cache, as this transformers names it
    with torch.no_grad():
        want_cache, got_cache = DynamicCache(config=model.config), DynamicCache(config=model.config)
        want = model(input_ids=ids, use_cache=True, **{kwarg: want_cache}).logits
        got = forward(input_ids=ids, use_cache=True, **{kwarg: got_cache}).logits
    assert torch.equal(got, want)
    assert len(got_cache.layers) == len(want_cache.layers) == model.config.num_hidden_layers
    assert all(torch.equal(g.keys, w.keys) and torch.equal(g.values, w.values)
               for g, w in zip(got_cache.layers, want_cache.layers))


def stepper_pair(mode: str, *, num_slots: int):
    """An eager decode stepper of a fresh tiny qwen2 and one whose forward is compiled in ``mode``
    (aot_eager), over one cache shape; dynamo's caches emptied first."""
    from rollout_lab.engine.runner.steppers import EagerStepper, StepperKey

    torch._dynamo.reset()
    model = get_tiny("qwen2")
    key = StepperKey(num_slots=num_slots, capacity=32, cache_kwarg=cache_kwarg_name(model), spans=False)
    eager, compiled = EagerStepper(model, key), EagerStepper(model, key)
    compiled.forward = compile_forward(model, mode, backend="aot_eager")
    return eager, compiled


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["model", "layers"])
def test_one_compile_serves_every_row_count_past_one(mode):
    """The decode step first traced with as many rows as slots must not pin rows == slots: 8, 4 and
    2 rows reuse the 16-row graph (no duck shapes), and tokens equal the eager step's."""
    eager, compiled = stepper_pair(mode, num_slots=16)
    counts = []
    with torch.no_grad():
        for rows in (16, 8, 4, 2):
            eager.reset()
            compiled.reset()
            assert torch.equal(compiled.step(rows, 0), eager.step(rows, 0)), rows
            counts.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert counts[1:] == counts[:1] * 3, counts  # no graph after the first row count's


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "opt"])
def test_one_trace_serves_every_layer(family):
    """Layer by layer, the decode step and a prefill into a DynamicCache trace one graph for all the
    layers of a 6-layer model (each layer is given its own cache layer, so nothing specialises on
    its index; before, every layer traced again), and give the eager forward's logits and cache."""
    from transformers import AutoModelForCausalLM, DynamicCache

    from rollout_lab.engine.runner.steppers import EagerStepper, StepperKey
    from rollout_lab.measure.models import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family, num_layers=6), attn_implementation="sdpa").eval()
    kwarg = cache_kwarg_name(model)
    counters = torch._dynamo.utils.counters
    torch._dynamo.reset()
    key = StepperKey(num_slots=4, capacity=32, cache_kwarg=kwarg, spans=False)
    eager, compiled = EagerStepper(model, key), EagerStepper(model, key)
    compiled.forward = compile_forward(model, "layers", backend="aot_eager")
    before = counters["stats"]["unique_graphs"]
    with torch.no_grad():
        for rows in (4, 2):
            eager.reset()
            compiled.reset()
            assert torch.equal(compiled.step(rows, 0), eager.step(rows, 0)), rows
    assert counters["stats"]["unique_graphs"] - before == 1
    torch._dynamo.reset()
    forward = compile_forward(model, "layers", backend="aot_eager")
    ids = torch.randint(3, 100, (3, 9), generator=torch.Generator().manual_seed(2))
    before = counters["stats"]["unique_graphs"]
    with torch.no_grad():
        want_cache, got_cache = DynamicCache(config=model.config), DynamicCache(config=model.config)
        want = model(input_ids=ids, use_cache=True, **{kwarg: want_cache}).logits
        got = forward(input_ids=ids, use_cache=True, **{kwarg: got_cache}).logits
    assert counters["stats"]["unique_graphs"] - before == 1
    assert torch.equal(got, want)
    assert all(torch.equal(g.keys, w.keys) and torch.equal(g.values, w.values)
               for g, w in zip(got_cache.layers, want_cache.layers))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["model", "layers"])
def test_the_first_trace_is_not_restarted(mode):
    """Under ``tracing()`` the compiled step's first call runs AOTAutograd once per graph: no frame
    restarted after a full trace because a module's float attribute (rope's attention_scaling) was
    traced as a symbol. The tokens are the eager step's."""
    from torch._dynamo.utils import counters

    from rollout_lab.engine.runner.compiling import tracing

    eager, compiled = stepper_pair(mode, num_slots=4)
    before = dict(counters["aot_autograd"])
    with torch.no_grad(), tracing():
        assert torch.equal(compiled.step(4, 0), eager.step(4, 0))
    assert torch._dynamo.config.specialize_float is False  # scoped: torch's default outside
    spent = {k: counters["aot_autograd"][k] - before.get(k, 0) for k in ("total", "ok")}
    assert spent["total"] == spent["ok"] >= 1, spent


@pytest.mark.slow
@pytest.mark.parametrize("backend, device", [
    ("aot_eager", "cpu"),
    # inductor's Triton code on the GPU, where the graph-captured step runs it (its CPU C++ code
    # mis-hashes: signed int64 overflow is undefined in C++, and wraps in Triton as in eager)
    pytest.param("inductor", "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                              reason="needs a CUDA GPU"))])
def test_compiled_select_draws_eagers_tokens(backend, device):
    """The decode step's compiled token choice (``compile_select``) equals ``select_tokens``: greedy,
    seeded sampling with and without top-k/top-p and the penalties, rows of mixed settings (greedy
    among them), min_new_tokens, logprobs, at two row counts (symbolic sizes: one compile serves
    both); traced with no graph break (``sampling.token_salts`` comes in as an argument)."""
    from rollout_lab.engine.runner.compiling import compile_select
    from rollout_lab.engine.sample.processors import RowPenalties, select_tokens
    from rollout_lab.engine.sample.sampler import RowSampling
    from rollout_lab.engine.sample.params import SamplingParams

    torch._dynamo.reset()
    earlier = dict(torch._dynamo.utils.counters["graph_break"])  # other tests' in this process
    select = compile_select(backend=backend)
    gen = torch.Generator().manual_seed(0)
    for params in (None, [SamplingParams()], [SamplingParams(temperature=0.7, top_k=20, top_p=0.9)],
                   [SamplingParams(0.7, 20, 0.9), SamplingParams(0), SamplingParams(1.3, 5), SamplingParams(top_p=0.5)]):
        for rows in (3, 5):
            sampling = None if params is None else RowSampling.of([params[i % len(params)] for i in range(rows)], device)
            logits = (torch.randn(rows, 1000, generator=gen) * 4).to(device)
            seen = (torch.rand(rows, 1000, generator=gen) < 0.05).to(device)
            keys = torch.randint(-2**62, 2**62, (rows,), generator=gen).to(device)
            steps = torch.randint(0, 500, (rows,), generator=gen).to(device)
            minimum = torch.randint(0, 500, (rows,), generator=gen).to(device)
            counts = torch.randint(0, 3, (rows, 1000), generator=gen, dtype=torch.int32).to(device)
            stop_mask = (torch.rand(rows, 1000, generator=gen) < 0.01).to(device)
            for penalty, mode in ((1.0, None), (1.3, "processed"), (1.0, "raw")):
                penalties = None if penalty == 1.0 else RowPenalties.of(
                    [(penalty, 0.5 * (i % 2), -0.3 * (i % 3)) for i in range(rows)], device)
                kwargs = dict(sampling=sampling, sample_keys=keys, steps=steps, logprobs_mode=mode, penalties=penalties,
                              seen=seen if penalties else None, counts=counts if penalties else None,
                              min_new_tokens=minimum if mode == "processed" else None, stop_mask=stop_mask)
                want, want_lp = select_tokens(logits, **kwargs)
                got, got_lp = select(logits, **kwargs)
                assert torch.equal(got, want)
                if mode is not None:
                    torch.testing.assert_close(got_lp, want_lp)
    breaks = {k: n for k, n in torch._dynamo.utils.counters["graph_break"].items() if n != earlier.get(k)}
    assert not breaks, list(breaks)  # token_salts comes in as an argument


@pytest.mark.slow
def test_compile_cost_script_records_both_float_settings(tmp_path):
    """scripts/compile_cost.py: each mode in its own process, tokens equal to eager, with the
    engine's float constants and with --symbolic-floats (the baseline)."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts/compile_cost.py"
    spec = importlib.util.spec_from_file_location("compile_cost", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    for flag, name in (([], "constants"), (["--symbolic-floats"], "symbolic")):
        script.main(["--layers", "1", "--rows", "4", "--modes", "model", "--backend", "aot_eager",
                     "--out", str(tmp_path / name), *flag])
        record = json.loads((tmp_path / f"{name}.json").read_text())
        assert record["config"]["symbolic_floats"] is bool(flag)
        assert [(r["mode"], r["rows"], r["equal_to_eager"]) for r in record["rows"]] == [("model", 4, True)]
        assert record["total_seconds"]["model"] == record["rows"][0]["seconds"] > 0
