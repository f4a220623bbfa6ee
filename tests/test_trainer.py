"""engine.trainer: the padded batch, the teacher-forced logprobs a trainer computes, and
``logprobs_mode="trainer"``, which returns exactly those bits (tiny fp32 models, CPU)."""
from __future__ import annotations

import importlib.util
import textwrap

import numpy as np
import pytest
import torch
from conftest import run_interpreted, get_tiny, one_fast

from rollout_lab import Rollout, RolloutConfig
from rollout_lab.engine.trainer import (clipped_policy_loss, eval_mode, group_advantages, padded_batch, policy_gradient_loss,
                                        rollout_logprobs, sequence_logprobs, token_logprobs)


PROMPTS = [[5, 9, 2, 4], [7], [3, 3, 8], [11, 2, 6, 6, 1], [4, 4]]
BUDGETS = [5, 2, 7, 3, 4]


def trainer_forward(model, result, *, fp32_head=False):
    """What a trainer computes: ``sequence_logprobs`` on ``result.to_tensors()``, [rows, R]."""
    t = result.to_tensors()
    with torch.no_grad():
        return sequence_logprobs(model, t["input_ids"], t["attention_mask"], t["response_mask"], fp32_head=fp32_head)


def max_abs_diff(a, b):
    assert [len(r) for r in a] == [len(r) for r in b]
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def test_padded_batch_left_pads_prompts_and_right_pads_responses():
    ids, mask, response_mask = padded_batch([[5, 6], [7]], [[1], [2, 3, 4]], pad_token_id=9)
    assert ids.tolist() == [[5, 6, 1, 9, 9], [9, 7, 2, 3, 4]]
    assert mask.tolist() == [[1, 1, 1, 0, 0], [0, 1, 1, 1, 1]]
    assert response_mask.tolist() == [[False, False, True, False, False], [False, False, True, True, True]]


@pytest.mark.parametrize("family", one_fast(["qwen2", "opt"], "qwen2"))
@pytest.mark.parametrize("mode", ["bucketed", "paged", "nocb"])
def test_trainer_logprobs_are_bit_identical_to_the_trainers_forward(family, mode):
    model = get_tiny(family)
    rollout = Rollout(model, RolloutConfig(mode=mode, continuous_batch_size=None if mode == "nocb" else 3))
    call = dict(max_new_tokens=BUDGETS, num_samples=2, do_sample=True, seed=1, return_logprobs=True)
    trainer = rollout.generate(PROMPTS, logprobs_mode="trainer", **call)
    assert len(trainer.sequences) == 10 and len(set(map(tuple, trainer.sequences))) > 5  # sampled rows differ
    assert (trainer_forward(model, trainer) - trainer.to_tensors()["logprobs"]).abs().max().item() == 0
    raw = rollout.generate(PROMPTS, **call)  # the decode step's own: the same tokens, equal up to rounding
    assert raw.sequences == trainer.sequences and max_abs_diff(raw.logprobs, trainer.logprobs) < 1e-5
    fp32 = rollout.generate(PROMPTS, logprobs_mode="trainer_fp32", **call)
    assert torch.equal(trainer_forward(model, fp32, fp32_head=True), fp32.to_tensors()["logprobs"])


def test_a_full_width_response_mask_gives_the_same_values():
    model = get_tiny("qwen3")
    t = Rollout(model).generate(PROMPTS, max_new_tokens=BUDGETS, return_logprobs=True,
                                logprobs_mode="trainer").to_tensors()
    width_p = t["prompt_ids"].shape[1]
    with torch.no_grad():
        full = sequence_logprobs(model, t["input_ids"], t["attention_mask"],
                                 torch.nn.functional.pad(t["response_mask"], (width_p, 0)))  # [rows, P + R]
    assert full.shape == t["input_ids"].shape and torch.equal(full[:, width_p:], t["logprobs"])
    assert bool((full[:, :width_p] == 0).all())


def test_trainer_logprobs_under_autograd_in_train_mode_are_the_same_bits_and_have_gradients():
    model = get_tiny("qwen2")
    result = Rollout(model).generate(PROMPTS, max_new_tokens=BUDGETS, return_logprobs=True, logprobs_mode="trainer")
    t = result.to_tensors()
    response_mask = t["response_mask"]
    model.train()
    try:
        logprobs = sequence_logprobs(model, t["input_ids"], t["attention_mask"], response_mask)
        assert torch.equal(logprobs.detach(), t["logprobs"])
        loss = policy_gradient_loss(logprobs, torch.tensor([1.0, -1.0, 0.5, 0.0, 2.0]), response_mask)
        loss.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    finally:
        model.eval()
        model.zero_grad(set_to_none=True)
    assert bool((logprobs[~response_mask] == 0).all()) and bool((logprobs[response_mask] < 0).all())


def test_rollout_logprobs_restore_each_modules_train_flag():
    model = get_tiny("llama")
    layer = model.get_decoder().layers[0]
    layer.train()
    try:
        rollout_logprobs(model, [[5, 6]], [[1, 2]], pad_token_id=0)
        assert layer.training and not model.training
        with eval_mode(model):
            assert not layer.training
        assert layer.training
    finally:
        model.eval()


def test_group_advantages_and_the_loss():
    advantages = group_advantages(torch.tensor([1.0, 3.0, 2.0, 2.0]), num_samples=2)
    assert torch.allclose(advantages, torch.tensor([-0.7071, 0.7071, 0.0, 0.0]), atol=1e-3)
    logprobs = torch.tensor([[0.0, -1.0, -2.0], [0.0, -3.0, 0.0]])
    response_mask = torch.tensor([[False, True, True], [False, True, False]])
    loss = policy_gradient_loss(logprobs, torch.tensor([1.0, -1.0]), response_mask)
    assert loss.item() == pytest.approx(-(-1.0 - 2.0 + 3.0) / 3)
    with pytest.raises(ValueError, match=r"rewards has 4 rows, not a multiple of num_samples=3"):
        group_advantages(torch.zeros(4), num_samples=3)


def test_rewards_and_advantages_may_be_lists_or_numpy_arrays():
    rewards = [1.0, 3.0, 2.0, 2.0, 0.0, 1.0]
    expected = group_advantages(torch.tensor(rewards), num_samples=2)
    for given in (rewards, tuple(rewards), np.array(rewards), np.array(rewards, dtype=np.float32),
                  [1, 3, 2, 2, 0, 1], [np.float64(r) for r in rewards]):
        got = group_advantages(given, num_samples=2)
        assert got.dtype == torch.float32 and torch.allclose(got, expected), given
    assert torch.equal(group_advantages([True, False], num_samples=2), group_advantages([1.0, 0.0], num_samples=2))
    logprobs = torch.tensor([[0.0, -1.0, -2.0], [0.0, -3.0, 0.0]])
    response_mask = torch.tensor([[False, True, True], [False, True, False]])
    for loss_of in (lambda a: policy_gradient_loss(logprobs, a, response_mask),
                    lambda a: clipped_policy_loss(logprobs, logprobs, a, response_mask)):
        assert torch.equal(loss_of([1.0, -1.0]), loss_of(torch.tensor([1.0, -1.0])))
        assert torch.equal(loss_of(np.array([1.0, -1.0])), loss_of(torch.tensor([1.0, -1.0])))


@pytest.mark.parametrize("call, error, message", [
    (lambda: group_advantages("1 0", num_samples=2), TypeError,
     "rewards must be a 1-D tensor, a numpy array or a list of numbers, got str"),
    (lambda: group_advantages({0: 1.0}, num_samples=1), TypeError, "got dict"),
    (lambda: group_advantages([1.0, "a"], num_samples=2), ValueError, "rewards must hold one real number per row"),
    (lambda: group_advantages([[1.0, 2.0]], num_samples=2), ValueError, r"1-D real numbers, one per row, got shape \(1, 2\)"),
    (lambda: group_advantages([1.0, 2.0, 3.0], num_samples=2), ValueError,
     "rewards has 3 rows, not a multiple of num_samples=2"),
    (lambda: group_advantages([1.0, 2.0], num_samples=0), ValueError, "num_samples must be an int >= 1, got 0"),
    (lambda: group_advantages([1.0, float("nan")], num_samples=2), ValueError,
     "rewards\\[1\\] is nan: every reward must be a finite number"),
    (lambda: group_advantages(np.array([float("inf"), 1.0]), num_samples=2), ValueError, r"rewards\[0\] is inf"),
    (lambda: group_advantages([1.0, 2.0], num_samples=2, eps=-1.0), ValueError,
     "eps must be a finite number >= 0, got -1.0"),
    (lambda: policy_gradient_loss(torch.zeros(2, 3), [1.0, 2.0, 3.0], torch.ones(2, 3, dtype=torch.bool)),
     ValueError, r"advantages has 3 rows, logprobs shape \(2, 3\)"),
    (lambda: policy_gradient_loss(torch.zeros(2, 3), [1.0, 2.0], torch.ones(2, 3, dtype=torch.long)),
     ValueError, r"response_mask must be a bool tensor of logprobs' shape \(2, 3\), got torch.int64 \(2, 3\)"),
])
def test_bad_rewards_and_advantages_are_named(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_the_clipped_loss_starts_as_the_policy_gradient_and_clips_past_the_trust_region():
    response_mask = torch.tensor([[False, True, True], [False, True, False]])
    advantages = torch.tensor([1.0, -1.0])
    start = torch.tensor([[0.0, -1.0, -2.0], [0.0, -3.0, 0.0]])
    grads = []
    for loss_of in (lambda x: policy_gradient_loss(x, advantages, response_mask),
                    lambda x: clipped_policy_loss(x, start, advantages, response_mask)):
        x = start.clone().requires_grad_(True)
        loss_of(x).backward()
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1])  # ratio exactly 1: the on-policy gradient, bit for bit
    moved = start + torch.tensor([[0.0, 0.5, 0.01], [0.0, -0.5, 0.0]])  # token 1 of each row past 1 +- 0.2
    x = moved.clone().requires_grad_(True)
    loss = clipped_policy_loss(x, start, advantages, response_mask, clip=0.2)
    loss.backward()
    assert x.grad[0, 1] == 0 and x.grad[1, 1] == 0  # clipped: the advantage already paid for
    assert x.grad[0, 2] < 0  # inside the region: pushed up by its positive advantage
    expected = -(1.2 * 1.0 + torch.exp(torch.tensor(0.01)).item() * 1.0 - 0.8) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    with pytest.raises(ValueError, match=r"clip must be a number in \(0, 1\), got 1.5"):
        clipped_policy_loss(x, start, advantages, response_mask, clip=1.5)
    with pytest.raises(ValueError, match="must have one shape"):
        clipped_policy_loss(x, start[:, :2], advantages, response_mask)


@pytest.mark.parametrize("change, message", [
    ({"response_mask": torch.ones(2, 4, dtype=torch.bool)}, "response_mask is set in column 0"),
    ({"response_mask": torch.zeros(2, 4, dtype=torch.long)}, "response_mask must be a bool tensor, got torch.int64"),
    ({"attention_mask": torch.ones(2, 3, dtype=torch.long)}, r"attention_mask has shape \(2, 3\), input_ids \(2, 4\)"),
    ({"response_mask": torch.zeros(2, 5, dtype=torch.bool)}, r"response_mask has shape \(2, 5\).*\[rows, R\] for the last"),
    ({"input_ids": torch.zeros(2, 4)}, "input_ids must be an integer tensor, got torch.float32"),
    ({"fp32_head": 1}, "fp32_head must be a bool, got 1"),
    ({"model": torch.nn.Linear(2, 2)}, "needs a Hugging Face causal LM with get_decoder"),
])
def test_bad_arguments_are_errors_before_any_forward(change, message):
    ids, mask, response_mask = padded_batch([[5, 6], [7]], [[1, 2], [3]], pad_token_id=0)
    args = {"model": get_tiny("qwen2"), "input_ids": ids, "attention_mask": mask,
            "response_mask": response_mask, "fp32_head": False} | change
    fp32_head = args.pop("fp32_head")
    with pytest.raises(ValueError, match=message):
        sequence_logprobs(*args.values(), fp32_head=fp32_head)
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        padded_batch([[5], [6]], [[1]], pad_token_id=0)


@pytest.mark.parametrize("prompts, responses, pad, message", [
    ([[5, "a"]], [[1]], 0, r"prompts\[0\]\[1\] is 'a': a token id must be an int >= 0"),
    ([[5]], [[1, 2.5]], 0, r"responses\[0\]\[1\] is 2.5"),  # dtype=torch.long would make it 2
    ([[5]], [[-3]], 0, r"responses\[0\]\[0\] is -3"),
    ([[5], [6]], [[1], [2**70]], 0, r"responses\[1\]\[0\] is 1180591620717411303424"),
    ([[5]], [[1]], -1, "pad_token_id must be an int >= 0, got -1"),
    ([[5, 6]], [[1, True]], 0, r"responses\[0\]\[1\] is True"),  # torch.tensor infers int64 for a bool among ints
    ([[5, torch.tensor(True)]], [[1]], 0, r"prompts\[0\]\[1\] is tensor\(True\)"),
])
def test_padded_batch_names_a_bad_id(prompts, responses, pad, message):
    with pytest.raises(ValueError, match=message):
        padded_batch(prompts, responses, pad_token_id=pad)


def test_padded_batch_takes_numpy_ints_and_0d_int_tensors_as_ids():
    ids, _, _ = padded_batch([[np.int64(5), torch.tensor(6)]], [[1, 2]], pad_token_id=0)
    assert ids.tolist() == [[5, 6, 1, 2]]


@pytest.mark.parametrize("bad", [-1, 384])
def test_ids_outside_the_vocabulary_are_named_with_one_host_sync_a_call(bad, monkeypatch):
    model = get_tiny("qwen2")  # vocabulary 384
    ids, mask, response_mask = padded_batch([[5, 6], [7]], [[1, 2], [3]], pad_token_id=0)
    with pytest.raises(ValueError, match=rf"input_ids holds token id {bad}, outside the vocabulary \[0, 384\)"):
        sequence_logprobs(model, ids.masked_fill(mask.bool(), bad), mask, response_mask)
    with pytest.raises(ValueError, match=rf"targets holds token id {bad}, outside the vocabulary \[0, 4\)"):
        token_logprobs(torch.zeros(2, 4), torch.tensor([0, bad]))
    reductions = []
    aminmax = torch.aminmax
    monkeypatch.setattr(torch, "aminmax", lambda *a, **k: reductions.append(1) or aminmax(*a, **k))
    monkeypatch.setattr("rollout_lab.engine.trainer.HEAD_CHUNK_TOKENS", 1)  # a chunk per row: the check is not per chunk
    with torch.no_grad():
        sequence_logprobs(model, ids, mask, response_mask)
    assert len(reductions) == 1


def plain_token_logprobs(logits, targets):
    """The head's log-softmax as plain torch: fp32 copy, gather, logsumexp."""
    x = logits.float()
    return x.gather(-1, targets[:, None])[:, 0] - torch.logsumexp(x, dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_and_their_gradient_match_plain_torch(dtype):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(6, 50, generator=gen) * 4).to(dtype)
    targets = torch.randint(0, 50, (6,), generator=gen)
    grad = torch.randn(6, generator=gen)
    mine = logits.clone().requires_grad_()
    plain = logits.clone().requires_grad_()
    got, want = token_logprobs(mine, targets), plain_token_logprobs(plain, targets)
    assert got.dtype == torch.float32 and torch.equal(got, want)  # the CPU form is the same ops
    (got * grad).sum().backward()
    (want * grad).sum().backward()
    assert mine.grad.dtype == dtype
    torch.testing.assert_close(mine.grad.float(), plain.grad.float(), atol=1e-6 if dtype == torch.float32 else 1e-2,
                               rtol=0)
    with pytest.raises(ValueError, match=r"logits \[N, vocab\] and targets \[N\], got \(6, 50\) and \(5,\)"):
        token_logprobs(logits, targets[:5])


KERNEL_CHECK = textwrap.dedent("""
    import torch
    from rollout_lab.engine.kernels.available import kernel_available
    from rollout_lab.engine.trainer import token_logprobs
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert kernel_available(device)
    gen = torch.Generator().manual_seed(1)
    # a vocabulary over several strips, one not a multiple of the strip, a one-entry row, a strided view
    for rows, vocab in ((5, 9000), (3, 4096), (2, 1), (7, 300)):
        for dtype in (torch.float32, torch.bfloat16):
            wide = (torch.randn(rows, vocab + 3, generator=gen) * 5).to(dtype)
            logits = wide[:, :vocab].to(device)
            targets = torch.randint(0, vocab, (rows,), generator=gen).to(device)
            x = logits.float()
            want = x.gather(-1, targets[:, None])[:, 0] - torch.logsumexp(x, -1)
            got = token_logprobs(logits, targets)
            assert got.dtype == torch.float32, got.dtype
            assert (got - want).abs().max().item() < 1e-4, (rows, vocab, dtype, (got - want).abs().max())
            # a row's value does not depend on the rows beside it
            assert torch.equal(token_logprobs(logits[1:2], targets[1:2]), got[1:2])
    print("logprob kernel ok")
""")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None or torch.cuda.is_available(),
                    reason="needs Triton (make test installs it) on a machine without CUDA")
def test_the_logprob_kernel_matches_torch_in_the_triton_interpreter():
    assert "logprob kernel ok" in run_interpreted(KERNEL_CHECK)


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
                    reason="needs a CUDA GPU and Triton")
def test_cuda_logprob_kernel_matches_torch():
    exec(KERNEL_CHECK, {})
