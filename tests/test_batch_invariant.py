"""Batch invariance of whole forwards (engine.kernels.batch_invariant): a rollout's tokens and logprobs
do not depend on its slots, and the trainer's invariant forward gives the rollout's logprobs bit for
bit in any micro-batch; every op the mode does not cover is a ValueError naming it.

The kernels run on CPU only under ``TRITON_INTERPRET=1`` (read when they are defined), so the
end-to-end check runs in a subprocess there; on a CUDA machine it runs on the GPU in bf16 and fp32.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen2 import modeling_qwen2

from conftest import run_interpreted
from rollout_lab import Rollout, RolloutConfig
from rollout_lab.engine.kernels.batch_invariant import (
    RMS_NORMS, InvariantOps, batch_invariant, check_invariant_model, key_starts, suspended,
)
from rollout_lab.engine.runner.compiling import compile_invariant_select
from rollout_lab.engine.sample.params import SamplingParams
from rollout_lab.engine.sample.processors import select_tokens
from rollout_lab.engine.sample.sampler import RowSampling
from rollout_lab.engine.trainer import sequence_logprobs
from rollout_lab.measure.models import tiny_model
from rollout_lab.measure.trainer_loop import check_trainer_loop_settings, TRAINER_LOOP_DEFAULTS

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def check_invariant_rollout(device: str, dtype: torch.dtype, slot_counts=(6, 2)) -> dict:
    """Seeded sampling with logprobs on a tiny Qwen2 at each of ``slot_counts``: the same tokens and
    logprob bits; the trainer's invariant forward in micro-batches of 1, 4 and all rows equals them
    bit for bit; a training step's gradients flow through the invariant forward."""
    model = tiny_model("qwen2", seed=0, attn_implementation="sdpa").to(device=device, dtype=dtype).eval()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 100, (int(n),), generator=gen).tolist()
               for n in torch.randint(3, 40, (6,), generator=gen)]
    rollouts = [Rollout(model, RolloutConfig(batch_invariant=True, continuous_batch_size=slots, kv_block_size=16))
                for slots in slot_counts]
    results = [r.generate(prompts, max_new_tokens=8, do_sample=True, seed=3, return_logprobs=True, progress=False)
               for r in rollouts]
    if device == "cuda":  # the captured step chooses with compile_invariant_select
        assert all(r.runner.stepper_info["select"] == "compiled" for r in rollouts)
    assert all(r.route == "paged" for r in results)
    norms = [m for m in model.modules() if isinstance(m, RMS_NORMS)]
    assert len(norms) == 2 * model.config.num_hidden_layers + 1
    plain_rope = modeling_qwen2.apply_rotary_pos_emb
    with batch_invariant(model):  # each norm and rotary embedding one kernel inside, the model's own after
        assert all("forward" in vars(m) for m in norms)
        assert modeling_qwen2.apply_rotary_pos_emb.original is plain_rope
    assert not any("forward" in vars(m) for m in norms) and modeling_qwen2.apply_rotary_pos_emb is plain_rope
    assert all(r.sequences == results[0].sequences for r in results), "tokens depend on the slots"
    assert all(r.logprobs == results[0].logprobs for r in results), "logprobs depend on the slots"
    t = results[0].to_tensors(device=device)
    mask = t["response_mask"]
    worst = {}
    for size in (1, 4, len(prompts)):
        pieces = [sequence_logprobs(model, t["input_ids"][s: s + size], t["attention_mask"][s: s + size],
                                    mask[s: s + size], batch_invariant=True) for s in range(0, len(prompts), size)]
        worst[size] = float((torch.cat(pieces) - t["logprobs"]).abs()[mask].max())
    assert all(value == 0.0 for value in worst.values()), worst
    plain = sequence_logprobs(model, t["input_ids"], t["attention_mask"], mask)
    assert float((plain - t["logprobs"]).abs()[mask].max()) < (1e-4 if dtype == torch.float32 else 0.2)
    model.train()
    logprobs = sequence_logprobs(model, t["input_ids"], t["attention_mask"], mask, batch_invariant=True)
    (-logprobs[mask].mean()).backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and bool(torch.isfinite(g).all()) for g in grads)
    assert any(float(g.abs().max()) > 0 for g in grads)
    return worst


@pytest.mark.slow
@pytest.mark.skipif(INTERPRETED, reason="runs its own interpreted subprocess")
def test_rollout_and_trainer_agree_bit_for_bit_in_the_interpreter():
    pytest.importorskip("triton")
    script = ("import torch; from test_batch_invariant import check_invariant_rollout; "
              "print(check_invariant_rollout('cpu', torch.float32))")
    assert "{1: 0.0, 4: 0.0, 6: 0.0}" in run_interpreted(script)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rollout_and_trainer_agree_bit_for_bit_on_cuda(dtype):
    check_invariant_rollout("cuda", dtype, slot_counts=(6, 3, 1))


@pytest.mark.parametrize("fields, named", [
    (dict(mode="bucketed"), "mode='bucketed'"),
    (dict(cache_capacity=64), "cache_capacity"),
    (dict(compile=True), "compile=True"),
    (dict(prefill_graphs=True), "prefill_graphs=True"),
    (dict(shared_prefix_attention="on"), "shared_prefix_attention='on'"),
])
def test_config_refuses_what_the_invariant_path_cannot_serve(fields, named):
    with pytest.raises(ValueError, match="batch_invariant") as error:
        RolloutConfig(batch_invariant=True, **fields)
    assert named in str(error.value)


def test_config_and_trainer_take_a_bool():
    with pytest.raises(ValueError, match="batch_invariant must be a bool, got 'yes'"):
        RolloutConfig(batch_invariant="yes")
    model = tiny_model("qwen2", seed=0)
    ids = torch.ones(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="batch_invariant must be a bool, got 1"):
        sequence_logprobs(model, ids, ids, ids.bool(), batch_invariant=1)


def test_trainer_loop_checks_the_route_before_any_work():
    settings = dict(TRAINER_LOOP_DEFAULTS, batch_invariant=True)  # mode "bucketed"
    with pytest.raises(ValueError, match="batch_invariant=True serves the paged route"):
        check_trainer_loop_settings(**settings)
    check_trainer_loop_settings(**(settings | {"mode": "paged"}))


def test_models_the_mode_does_not_cover_are_named_before_any_work():
    with pytest.raises(ValueError, match="does not cover OPTForCausalLM's LayerNorm"):
        check_invariant_model(tiny_model("opt", seed=0))
    if not INTERPRETED:  # no Triton kernel runs on a CPU tensor outside the interpreter
        model = tiny_model("qwen2", seed=0)
        with pytest.raises(ValueError, match="needs the Triton kernels: a CUDA device, or TRITON_INTERPRET=1"):
            Rollout(model, RolloutConfig(batch_invariant=True))
        with pytest.raises(ValueError, match="needs the Triton kernels"):
            sequence_logprobs(model, torch.ones(1, 3, dtype=torch.long), torch.ones(1, 3, dtype=torch.long),
                              torch.tensor([[False, True, True]]), batch_invariant=True)


def test_uncovered_ops_are_named_and_order_free_ones_pass():
    x = torch.randn(3, 5)
    with InvariantOps():
        for run, op in ((lambda: torch.cumsum(x, -1), "aten.cumsum"), (lambda: x.sum(), "aten.sum"),
                        (lambda: F.layer_norm(x, (5,)), "aten.native_layer_norm"),
                        (lambda: torch.var(x, -1), "aten.var")):
            with pytest.raises(ValueError, match=f"does not cover {op}"):
                run()
        with pytest.raises(ValueError, match="last dimension only"):
            x.mean(0)
        assert int(torch.arange(4).sum()) == 6  # integer sums are exact
        assert torch.equal(x.argmax(-1), x.detach().argmax(-1)) and torch.equal(x.amax(-1), x.max(-1).values)
        y = torch.where(x > 0, x * 2, -x).exp()  # element-wise
    assert torch.equal(y, torch.where(x > 0, x * 2, -x).exp())


def test_key_starts_reads_left_padding_and_refuses_holes():
    rows, width = 3, 7
    pad = torch.tensor([0, 2, 5])
    cols = torch.arange(width)
    mask = (cols[None, None, :] <= cols[None, :, None]) & (cols[None, None, :] >= pad[:, None, None])  # [B, q, S]
    query, key = torch.zeros(rows, 2, width, 4), torch.zeros(rows, 1, width, 4)
    assert key_starts(mask[:, None], query, key).tolist() == [0, 2, 5]
    additive = torch.where(mask, 0.0, float("-inf"))[:, None]
    assert key_starts(additive, query, key).tolist() == [0, 2, 5]
    assert key_starts(None, query, key).tolist() == [0, 0, 0]
    holed = mask.clone()
    holed[1, :, 3] = False  # a pad inside row 1
    with pytest.raises(ValueError, match="row 1's attention mask is not one run of keys"):
        key_starts(holed[:, None], query, key)


def test_suspended_runs_ops_as_they_are_inside_the_mode_only():
    x = torch.randn(3, 5)
    with InvariantOps():
        with suspended():
            assert torch.equal(torch.cumsum(x, -1), x.cumsum(-1))  # no ValueError: the mode is off
        with pytest.raises(ValueError, match="does not cover aten.cumsum"):
            torch.cumsum(x, -1)  # and back on after
    with suspended():  # outside the mode: nothing to suspend
        assert torch.cumsum(x, -1).shape == (3, 5)


def test_invariant_select_draws_as_the_eager_choice():
    """The compiled token choice (dynamo's eager backend here: inductor's CPU code is not the GPU's)
    runs with the mode suspended and draws the eager step's tokens, top-k and greedy rows among them."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 300, generator=gen)
    params = [SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.3, top_k=40)]
    sampling = RowSampling.of(params, "cpu")
    keys, steps = torch.tensor([3, 4, 5, 6]), torch.tensor([1, 2, 3, 4])
    want, _ = select_tokens(logits, sampling=sampling, sample_keys=keys, steps=steps)
    select = compile_invariant_select(backend="eager")
    with InvariantOps():
        got, logprobs = select(logits, sampling=sampling, sample_keys=keys, steps=steps, logprobs_mode=None)
    assert torch.equal(got, want) and logprobs is None
    assert int(got[2]) == int(logits[2].argmax())  # the greedy row
