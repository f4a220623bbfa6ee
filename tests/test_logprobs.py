"""result.logprobs: each generated token's log-probability, computed in the decode step, equal on
every route to an independent teacher-forced forward ("raw") or to the sampler's own distribution
("processed")."""
from __future__ import annotations

import pytest
import torch
from conftest import get_tiny, one_fast

from rollout_lab import Rollout, RolloutConfig
from rollout_lab.engine.sample.processors import RowPenalties, apply_penalties, seen_from_ids
from rollout_lab.engine.sample.sampler import RowSampling, filter_logits
from rollout_lab.engine.sample.params import SamplingParams
from rollout_lab.measure.models import TINY_FAMILIES

ROUTES = ("nocb", "equal_width", "aligned", "bucketed", "packed", "paged", "auto")
PROMPTS = [[5, 9, 2, 4], [7], [3, 3, 8], [11, 2, 6, 6, 1], [4, 4]]


@torch.no_grad()
def reference(model, prompts, sequences, *, mode="raw", penalty=1.0, sampling=None):
    """Teacher-forced: one plain forward per request over prompt + its tokens."""
    out = []
    vocab = model.get_input_embeddings().weight.shape[0]
    for prompt, seq in zip(prompts, sequences):
        ids = torch.tensor([prompt + seq[:-1]])
        logits = model(input_ids=ids).logits[0].float()  # [len, vocab]
        row = []
        for t, token in enumerate(seq):
            scores = logits[len(prompt) - 1 + t][None]
            if mode == "processed":
                before = torch.tensor([prompt + seq[:t]])
                if penalty != 1.0:
                    seen = seen_from_ids(before, torch.ones_like(before, dtype=torch.bool), vocab)
                    scores = apply_penalties(scores, RowPenalties.of([(penalty, 0.0, 0.0)], "cpu"), seen=seen, counts=None)
                if sampling is not None:
                    scores = filter_logits(scores, RowSampling.of([sampling], "cpu"))
            row.append(float(scores[0, token] - torch.logsumexp(scores[0], -1)))
        out.append(row)
    return out


def assert_close(got, want, tol=1e-5):
    assert [len(r) for r in got] == [len(r) for r in want]
    worst = max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g, w))
    assert worst < tol, worst


@pytest.mark.parametrize("family", one_fast(TINY_FAMILIES, "qwen3"))
@pytest.mark.parametrize("slots", one_fast([None, 2], 2))
def test_raw_logprobs_equal_a_teacher_forced_forward(family, slots):
    model = get_tiny(family)
    budgets = [5, 2, 7, 3, 4]
    for mode in ROUTES if slots is None else ROUTES[1:]:
        config = RolloutConfig(mode=mode, continuous_batch_size=slots)
        result = Rollout(model, config).generate(PROMPTS, max_new_tokens=budgets, return_logprobs=True)
        assert_close(result.logprobs, reference(model, PROMPTS, result.sequences))


@pytest.mark.parametrize("mode", ["nocb", "bucketed", "packed"])
def test_processed_logprobs_are_the_samplers_distribution(mode):
    model = get_tiny("qwen2")
    sampling = SamplingParams(temperature=0.7, top_k=30, top_p=0.9)
    config = RolloutConfig(mode=mode, repetition_penalty=1.3, continuous_batch_size=None if mode == "nocb" else 3)
    rollout = Rollout(model, config)
    result = rollout.generate(PROMPTS, max_new_tokens=6, do_sample=True, temperature=0.7, top_k=30, top_p=0.9,
                              seed=3, return_logprobs=True, logprobs_mode="processed")
    assert_close(result.logprobs, reference(model, PROMPTS, result.sequences, mode="processed", penalty=1.3,
                                            sampling=sampling), tol=2e-5)
    raw = rollout.generate(PROMPTS, max_new_tokens=6, do_sample=True, temperature=0.7, top_k=30, top_p=0.9,
                           seed=3, return_logprobs=True)
    assert raw.sequences == result.sequences
    assert_close(raw.logprobs, reference(model, PROMPTS, raw.sequences))
    assert all(lp <= 0 for row in result.logprobs for lp in row)


def test_logprobs_follow_eos_and_samples():
    model = get_tiny("llama")
    free = Rollout(model).generate(PROMPTS, max_new_tokens=8).sequences
    eos = free[0][2]
    result = Rollout(model, RolloutConfig(eos_token_id=eos, continuous_batch_size=2)).generate(
        PROMPTS, max_new_tokens=8, num_samples=2, return_logprobs=True)
    assert [len(lp) for lp in result.logprobs] == [len(s) for s in result.sequences]
    assert any(len(s) < 8 for s in result.sequences)
    assert Rollout(model).generate(PROMPTS, max_new_tokens=2).logprobs is None  # only when asked


def test_logprob_settings_are_checked():
    rollout = Rollout(get_tiny("qwen2"))
    with pytest.raises(ValueError, match="logprobs_mode must be one of"):
        rollout.generate(PROMPTS, max_new_tokens=2, return_logprobs=True, logprobs_mode="softmax")
    with pytest.raises(ValueError, match="return_logprobs must be a bool"):
        rollout.generate(PROMPTS, max_new_tokens=2, return_logprobs="yes")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_step_logprobs_equal_eager():
    """fp32: the captured (compiled, span-attention) step's logprobs are the eager step's."""
    from rollout_lab.measure.models import tiny_model

    model = tiny_model("qwen3", seed=0).to("cuda")
    kwargs = dict(max_new_tokens=[5, 2, 7, 3, 4], return_logprobs=True)
    eager = Rollout(model, RolloutConfig(mode="bucketed", decode="eager", continuous_batch_size=2)).generate(PROMPTS, **kwargs)
    with Rollout(model, RolloutConfig(mode="bucketed", decode="graph", continuous_batch_size=2)) as rollout:
        graph = rollout.generate(PROMPTS, **kwargs)
    assert graph.sequences == eager.sequences
    assert_close(graph.logprobs, eager.logprobs, tol=1e-4)
