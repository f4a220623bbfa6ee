"""RolloutResult's views of its flat fields: ``requests`` (one RequestOutput per request, vLLM's shape)
and ``to_tensors()`` (the padded tensors of a policy-gradient loss)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import CharTokenizer, get_tiny

from rollout_lab import Rollout, RolloutConfig
from rollout_lab.engine.api.result import RequestOutput, SampleOutput

PROMPTS = [[5, 9, 2, 4], [7], [3, 3, 8, 1, 6, 6], [11, 2]]
SAMPLE = dict(max_new_tokens=7, num_samples=3, do_sample=True, seed=3)


def eos_of(model) -> int:
    """A token the sampled rows reach early, as EOS: rows of several lengths and both finish reasons."""
    return Rollout(model).generate(PROMPTS, **SAMPLE).sequences[0][2]


@pytest.mark.parametrize("mode", ["nocb", "bucketed", "packed", "paged"])
def test_requests_view_the_flat_fields(mode):
    model = get_tiny("qwen2")
    config = RolloutConfig(mode=mode, eos_token_id=eos_of(model))
    result = Rollout(model, config, tokenizer=CharTokenizer()).generate(PROMPTS, return_logprobs=True, **SAMPLE)
    assert set(result.finish_reasons) == {"stop", "length"}
    assert len(result.requests) == len(PROMPTS)
    for r, request in enumerate(result.requests):
        assert isinstance(request, RequestOutput) and request.prompt_token_ids == PROMPTS[r]
        assert len(request.outputs) == 3
        for s, sample in enumerate(request.outputs):
            row = r * 3 + s
            assert sample == SampleOutput(result.sequences[row], result.logprobs[row], result.finish_reasons[row],
                                          result.texts[row])
    assert [[o.token_ids for o in q.outputs] for q in result.requests] == result.grouped()
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.requests[0].outputs[0].token_ids = []
    plain = Rollout(model, RolloutConfig(mode=mode)).generate(PROMPTS, max_new_tokens=3)
    assert [(o.logprobs, o.text) for q in plain.requests for o in q.outputs] == [(None, None)] * len(PROMPTS)


def test_requests_hold_the_unpadded_prompts():
    ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 1]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    result = Rollout(get_tiny("llama")).generate(ids, attention_mask=mask, max_new_tokens=2)
    assert [q.prompt_token_ids for q in result.requests] == [[5, 6], [7, 8, 9, 1]]


def test_to_tensors_pads_prompts_left_and_responses_right():
    model = get_tiny("qwen3")
    result = Rollout(model, RolloutConfig(eos_token_id=eos_of(model))).generate(
        PROMPTS, return_logprobs=True, **SAMPLE)
    assert len({len(s) for s in result.sequences}) > 1  # responses of several lengths: padding to check
    t = result.to_tensors()
    rows, width, length = len(PROMPTS) * 3, max(map(len, PROMPTS)), max(map(len, result.sequences))
    shapes = {"prompt_ids": (rows, width), "response_ids": (rows, length), "response_mask": (rows, length),
              "logprobs": (rows, length), "input_ids": (rows, width + length),
              "attention_mask": (rows, width + length), "loss_mask": (rows, length)}
    assert {name: tuple(v.shape) for name, v in t.items()} == shapes
    assert torch.equal(t["loss_mask"], t["response_mask"])  # no episode: every response token is the model's
    assert t["response_mask"].dtype == torch.bool and t["logprobs"].dtype == torch.float32
    assert t["input_ids"].dtype == t["attention_mask"].dtype == torch.long
    pad = result.pad_token_id
    for row, (seq, logprobs) in enumerate(zip(result.sequences, result.logprobs)):
        prompt = PROMPTS[row // 3]  # request-major rows
        left, right = width - len(prompt), length - len(seq)
        assert t["prompt_ids"][row].tolist() == [pad] * left + prompt
        assert t["response_ids"][row].tolist() == seq + [pad] * right
        assert t["response_mask"][row].tolist() == [True] * len(seq) + [False] * right
        assert t["logprobs"][row].tolist() == pytest.approx(logprobs + [0.0] * right)
        assert t["attention_mask"][row].tolist() == [0] * left + [1] * (len(prompt) + len(seq)) + [0] * right
    assert torch.equal(t["input_ids"], torch.cat([t["prompt_ids"], t["response_ids"]], 1))
    padded = result.to_tensors(pad_token_id=7, device="cpu")
    assert torch.equal(padded["input_ids"] == 7, (t["input_ids"] == 7) | (t["attention_mask"] == 0))


def test_to_tensors_without_logprobs_and_of_an_empty_call():
    model = get_tiny("opt")
    t = Rollout(model).generate(PROMPTS, max_new_tokens=3).to_tensors()
    assert "logprobs" not in t and bool(t["response_mask"].all())
    empty = Rollout(model).generate([], max_new_tokens=3)
    assert empty.requests == [] and {tuple(v.shape) for v in empty.to_tensors().values()} == {(0, 0)}
    with pytest.raises(ValueError, match="pad_token_id must be an int >= 0"):
        empty.to_tensors(pad_token_id=-1)
