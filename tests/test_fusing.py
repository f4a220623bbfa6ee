"""engine.runner.fusing: a decoder layer's q/k/v and gate/up projections as one matmul each, in a shallow
copy of the model whose stacked weights follow the model's (refresh), eager and traced."""
from __future__ import annotations

import pytest
import torch
from conftest import get_tiny, one_fast
from torch.utils._python_dispatch import TorchDispatchMode

from rollout_lab.engine.api.config import RolloutConfig
from rollout_lab.engine.runner.fusing import FusedProjections, fusable, fused_nbytes
from rollout_lab.engine.api.rollout import Rollout
from rollout_lab.engine.runner.steppers import resolve_fuse
from rollout_lab.measure.models import tiny_model


class CountMatmuls(TorchDispatchMode):
    """Counts the aten matmuls a forward runs."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.count += 1
        return func(*args, **(kwargs or {}))


def ids(rows: int = 3, width: int = 7, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 100, (rows, width), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family, groups", [("qwen2", 2), ("qwen3", 2), ("llama", 2), ("opt", 1)])
def test_each_family_fuses_its_groups_and_runs_fewer_matmuls(family, groups):
    model = get_tiny(family)
    layers = model.config.num_hidden_layers
    assert len(fusable(model)) == groups * layers  # opt's MLP is fc1/fc2: nothing to stack there
    fused = FusedProjections(model)
    assert sum(t.nbytes for t in fused.tensors()) == fused_nbytes(model) > 0
    x = ids()
    with torch.no_grad():
        with CountMatmuls() as plain:
            want = model(input_ids=x).logits
        with CountMatmuls() as once:
            got = fused.model(input_ids=x).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # q, k, v -> 1 and gate, up -> 1: three matmuls fewer per layer (two for opt)
    assert plain.count - once.count == (3 if groups == 2 else 2) * layers, (plain.count, once.count)


def test_the_model_itself_is_left_alone():
    model = get_tiny("qwen2")
    fused = FusedProjections(model)
    attn, twin = model.model.layers[0].self_attn, fused.model.model.layers[0].self_attn
    assert type(attn.q_proj) is torch.nn.Linear and type(twin.q_proj) is not torch.nn.Linear
    assert twin.o_proj is attn.o_proj and fused.model.lm_head is model.lm_head  # shared, not copied
    assert fused.model.model.embed_tokens is model.model.embed_tokens
    names = {n for n, _ in model.named_parameters()}
    assert "model.layers.0.self_attn.q_proj.weight" in names  # its parameters are unchanged
    assert all(p.data_ptr() != w.data_ptr() for p in model.parameters() for w in fused.tensors())


def test_refresh_follows_in_place_updates_and_replaced_parameters():
    model = tiny_model("qwen2", seed=3)
    fused = FusedProjections(model)
    x = ids(seed=2)
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight.mul_(1.5)  # an optimizer's in-place step
        state = {k: v.clone() for k, v in model.state_dict().items()}
        state["model.layers[0].self_attn.k_proj.bias".replace("[0]", ".0")] += 0.25
        model.load_state_dict(state, assign=True)  # a weight sync into new tensors
        want = model(input_ids=x).logits
        stale = fused.model(input_ids=x).logits
        fused.refresh()
        got = fused.model(input_ids=x).logits
    assert not torch.allclose(stale, want, atol=1e-4)  # the copy is a copy until refreshed
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_members_called_on_other_inputs_compute_their_own_product():
    model = get_tiny("llama")
    fused = FusedProjections(model)
    twin = fused.model.model.layers[0].self_attn
    a, b = torch.randn(2, 5, model.config.hidden_size), torch.randn(2, 5, model.config.hidden_size)
    original = model.model.layers[0].self_attn
    with torch.no_grad():
        q, k = twin.q_proj(a), twin.k_proj(b)  # k on another input than q's: not q's product
        v = twin.v_proj(b)
        torch.testing.assert_close(q, original.q_proj(a))
        torch.testing.assert_close(k, original.k_proj(b))
        torch.testing.assert_close(v, original.v_proj(b))


@pytest.mark.slow
def test_traced_once_without_a_break_and_four_linears_a_layer():
    """Dynamo traces the parts' bookkeeping away: one graph, and F.linear four times a layer (+ the head)."""
    torch._dynamo.reset()
    model = get_tiny("qwen3")
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    fused = FusedProjections(model)
    compiled = torch.compile(fused.model, backend=backend, dynamic=True)
    x = ids()
    with torch.no_grad():
        want = model(input_ids=x).logits
        got = compiled(input_ids=x).logits
        again = compiled(input_ids=ids(seed=5)).logits  # the same graph: no guard on the parts' state
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert again.shape == want.shape
    assert len(graphs) == 1
    linears = [n for n in graphs[0].graph.nodes if n.op == "call_function"
               and n.target is torch._C._nn.linear]
    assert len(linears) == 4 * model.config.num_hidden_layers + 1


@pytest.mark.parametrize("family", one_fast(["qwen2", "opt"], "qwen2"))
@pytest.mark.parametrize("mode", one_fast(["bucketed", "paged"], "paged"))
def test_a_rollout_with_fused_projections_makes_the_unfused_tokens_across_weight_updates(family, mode):
    """fp32 on the CPU: the fused step's tokens are the unfused step's, greedy and sampled, and still
    are after the weights change between calls (the kept step refreshes its stacked copy)."""
    prompts = [list(range(5, 5 + n)) for n in (7, 3, 11, 5, 9)]
    models = [tiny_model(family, seed=4), tiny_model(family, seed=4)]
    rollouts = [Rollout(m, RolloutConfig(mode=mode, continuous_batch_size=3, fuse_projections=f))
                for m, f in zip(models, (True, False))]
    assert rollouts[0].runner.fused and not rollouts[1].runner.fused
    calls = [dict(max_new_tokens=[6, 9, 4, 8, 5]), dict(max_new_tokens=7, do_sample=True, temperature=1.0, seed=3)]
    for call in calls:  # one kind of call at a time: each kind keeps its own step across the updates
        for update in range(3):
            if update:
                with torch.no_grad():
                    for m in models:
                        m.get_submodule(fusable(m)[0][0]).v_proj.weight.add_(0.05)  # both alike
            fused, plain = (r.generate(prompts, **call) for r in rollouts)
            assert fused.sequences == plain.sequences, (update, call)
    assert rollouts[0].stepper_info["fused"] is True


def test_fuse_projections_is_checked_and_resolved():
    with pytest.raises(ValueError, match="fuse_projections must be 'auto', True or False, got 'yes'"):
        RolloutConfig(fuse_projections="yes")
    model = get_tiny("qwen2")
    assert resolve_fuse(True, "eager", model) is True
    assert resolve_fuse("auto", "eager", model) is False  # "auto" fuses the graph-captured step only
    assert resolve_fuse(False, "graph", model) is False
    assert resolve_fuse(True, "eager", torch.nn.Sequential(torch.nn.Linear(2, 2))) is False  # nothing to fuse


@pytest.mark.slow
def test_the_fused_copy_compiles_layer_by_layer_too():
    """compile="layers" over the fused copy: its own layer list, compiled one layer at a time, one
    graph for every layer (nothing in the fused parts specialises on the layer)."""
    from rollout_lab.engine.runner.compiling import compile_forward, decoder_layers

    torch._dynamo.reset()
    model = get_tiny("qwen2")
    fused = FusedProjections(model)
    forward = compile_forward(fused.model, "layers", backend="aot_eager")
    x = ids(seed=7)
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with torch.no_grad():
        want = model(input_ids=x).logits
        got = forward(input_ids=x).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 1
    name = decoder_layers(model)
    compiled = forward.get_submodule(name)
    assert all(c.compiled._orig_mod is f for c, f in zip(compiled, fused.model.get_submodule(name)))
    assert all(type(layer.self_attn.q_proj) is torch.nn.Linear for layer in model.get_submodule(name))
