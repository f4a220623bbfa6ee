"""measure.trainer_loop: rollout alternated with a GRPO step on one model, behind
`rollout-lab bench trainer-loop` (tiny fp32 models, CPU; each test trains its own model)."""
from __future__ import annotations

import inspect
import json

import pytest
import torch

from rollout_lab.cli.main import main
from rollout_lab.measure import trainer_loop as trainer_loop_module
from rollout_lab.measure.models import tiny_model
from rollout_lab.measure.trainer_loop import (TRAINER_LOOP_DEFAULTS, check_trainer_loop_settings, decode_captures,
                                              replace_parameters, run_trainer_loop, trainer_loop_rows)
from rollout_lab.workspace import check_record_pair

TINY_SHAPE = {"num_prompts": 4, "num_samples": 2, "max_new_tokens": 8, "scale": 0.1, "iterations": 2}


def quiet(line: str) -> None:
    pass


@pytest.mark.parametrize("logprobs_mode, train_rows", [("raw", None), ("trainer", 3)])
def test_the_loop_records_every_iteration_and_the_logprob_mismatch(logprobs_mode, train_rows):
    model = tiny_model("qwen2", seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    saved = []
    record = run_trainer_loop(model, model_name="tiny-qwen2", dtype="float32", logprobs_mode=logprobs_mode,
                              train_rows=train_rows, save=lambda r: saved.append(json.loads(json.dumps(r))),
                              progress=quiet, script="test", **TINY_SHAPE)
    iterations = record["results"]["iterations"]
    assert [len(r["results"]["iterations"]) for r in saved] == [1, 2]  # saved after every iteration
    assert record["kind"] == "trainer_loop" and record["provenance"]["script"] == "test"
    assert record["config"]["logprobs_mode"] == logprobs_mode and record["workload"]["num_rows"] == 8
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))  # AdamW stepped every weight
    assert not model.training  # left in eval mode
    for it in iterations:
        assert it["first_rollout_ms"] > 0 and it["steady_rollout_ms"] > 0 and it["train_ms"] > 0
        assert it["decode_captures"] == 0 and not it["stepper_rebuilt"] and it["steady_same_tokens"]
        assert it["peak_rollout_bytes"] is None and it["assign_ms"] is None
        mismatch = it["logprob_mismatch"]
        if logprobs_mode == "trainer":  # the trainer's forward in its micro-batches of 3 rows, train mode, autograd
            assert mismatch["max_abs"] == 0 and mismatch["equal_share"] == 1
        else:  # the decode step's own logprobs: fp32 rounding only
            assert 0 < mismatch["max_abs"] < 1e-4 and mismatch["mean_abs"] <= mismatch["max_abs"]
    rows = trainer_loop_rows(record)
    assert [r["iteration"] for r in rows] == [0, 1]
    assert rows[1]["logprob_max_abs"] == iterations[1]["logprob_mismatch"]["max_abs"] and rows[0]["peak_train_gb"] is None


def test_assign_and_checkpointing_run_and_leave_the_model_trainable():
    model = tiny_model("llama", seed=0)
    record = run_trainer_loop(model, model_name="tiny-llama", dtype="float32", assign=True,
                              gradient_checkpointing=True, train_mode="toggle", progress=quiet, **TINY_SHAPE)
    assert all(it["assign_ms"] > 0 for it in record["results"]["iterations"])
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules()) and not model.training


@pytest.mark.parametrize("train_mode, step_training", [("toggle", True), ("eval", False)])
def test_train_mode_is_the_trainer_steps_and_the_rollout_is_in_eval_mode(train_mode, step_training, monkeypatch):
    model = tiny_model("qwen2", seed=0)
    seen = {"rollout": [], "step": []}
    generate, step = trainer_loop_module.Rollout.generate, trainer_loop_module.train_step

    def watched_generate(self, *args, **kwargs):
        seen["rollout"].append(any(m.training for m in self.model.modules()))
        return generate(self, *args, **kwargs)

    def watched_step(net, *args, **kwargs):
        seen["step"].append(net.training)
        return step(net, *args, **kwargs)

    monkeypatch.setattr(trainer_loop_module.Rollout, "generate", watched_generate)
    monkeypatch.setattr(trainer_loop_module, "train_step", watched_step)
    record = run_trainer_loop(model, model_name="tiny-qwen2", dtype="float32", train_mode=train_mode, progress=quiet,
                              **(TINY_SHAPE | {"iterations": 1}))
    assert record["config"]["train_mode"] == train_mode
    assert seen == {"rollout": [False] * 3, "step": [step_training]}  # warm-up, first and steady; one step


def test_the_bench_explains_train_mode_train_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("rollout_lab.cli.bench.build_model", lambda *a, **k: pytest.fail("a model was built"))
    assert main(["bench", "trainer-loop", "--tiny", "qwen2", "--out", str(tmp_path / "x"), "--train-mode", "train"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert "train_mode='train' ran the rollouts in train mode" in err and "give 'toggle'" in err


def test_replace_parameters_gives_new_storage_keeps_ties_and_moves_the_optimizer_state():
    model = tiny_model("qwen2", seed=0)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    optimizer.step()
    old = list(model.parameters())
    replace_parameters(model, optimizer)
    new = list(model.parameters())
    assert len(new) == len(old) and all(a.data_ptr() != b.data_ptr() and torch.equal(a, b) for a, b in zip(old, new))
    assert model.lm_head.weight is model.get_input_embeddings().weight
    assert all(p in optimizer.state and p.requires_grad for p in new) and optimizer.param_groups[0]["params"] == new


def test_decode_captures_count_a_rebuilt_steppers_own():
    kept = {"kind": "graph", "build_ms": 5.0, "num_captures": 1}
    assert decode_captures(kept, kept) == (0, False)
    assert decode_captures(kept, kept | {"build_ms": 7.0}) == (1, True)
    assert decode_captures({"kind": None}, {"kind": None}) == (0, False)


@pytest.mark.parametrize("bad, message", [
    ({"logprobs_mode": "softmax"}, r"logprobs_mode must be one of \['raw', 'processed', 'trainer', 'trainer_fp32'\]"),
    ({"train_mode": "train()"}, r"train_mode must be one of \['toggle', 'eval'\], got 'train\(\)'"),
    ({"train_mode": "train"}, r"train_mode='train' ran the rollouts in train mode, which Rollout.generate no longer "
                              r"does .*give 'toggle' \(train\(\) for the trainer step, eval\(\) for the rollout\) or 'eval'"),
    ({"train_rows": 0}, "train_rows must be None .* or an int >= 1, got 0"),
    ({"iterations": 0}, "iterations must be an int >= 1, got 0"),
    ({"lr": float("nan")}, "lr must be a number > 0, got nan"),
    ({"assign": "yes"}, "assign must be a bool, got 'yes'"),
    ({"mode": "vllm"}, "mode must be one of"),
    ({"dataset": "mmlu"}, "dataset must be one of"),
])
def test_bad_settings_are_errors_before_any_work(bad, message, monkeypatch):
    monkeypatch.setattr(trainer_loop_module, "Rollout", lambda *a, **k: pytest.fail("a rollout was built"))
    with pytest.raises(ValueError, match=message):
        check_trainer_loop_settings(**(dict(TRAINER_LOOP_DEFAULTS) | bad))
    with pytest.raises(ValueError, match=message):
        run_trainer_loop(tiny_model("qwen2"), model_name="tiny-qwen2", dtype="float32", **bad)


def test_a_scale_that_clips_a_prompt_to_one_token_is_refused_by_the_run_too(monkeypatch):
    """run_trainer_loop(scale=0.001) clipped every prompt to one token silently; the check the CLI
    shares (grpo.scaled_prompt_lengths) names scale >= 1/shortest."""
    monkeypatch.setattr(trainer_loop_module, "Rollout", lambda *a, **k: pytest.fail("a rollout was built"))
    message = r"scale=0.001 makes the shortest of these prompts \(70 tokens of gsm8k\).*give scale >= 0.0143 \(1/70\)"
    with pytest.raises(ValueError, match=message):
        check_trainer_loop_settings(**(dict(TRAINER_LOOP_DEFAULTS) | {"scale": 0.001}))
    with pytest.raises(ValueError, match=message):
        run_trainer_loop(tiny_model("qwen2"), model_name="tiny-qwen2", dtype="float32", scale=0.001)


def test_trainer_loop_defaults_are_run_trainer_loops_own():
    signature = inspect.signature(run_trainer_loop).parameters
    assert {k: signature[k].default for k in TRAINER_LOOP_DEFAULTS} == TRAINER_LOOP_DEFAULTS


@pytest.mark.slow  # the bench on a tiny model
def test_bench_trainer_loop_writes_the_record_and_refuses_an_existing_one(tmp_path, capsys, monkeypatch):
    out = tmp_path / "trainer_loop"
    argv = ["--tiny", "qwen2", "--num-prompts", "4", "--num-samples", "2", "--max-new-tokens", "8", "--scale", "0.1",
            "--iterations", "2", "--logprobs-mode", "trainer", "--train-rows", "4", "--out", str(out)]
    assert main(["bench", "trainer-loop", *argv]) == 0
    record = json.loads((tmp_path / "trainer_loop.json").read_text())
    assert check_record_pair(tmp_path / "trainer_loop.json", tmp_path / "trainer_loop.csv") == record["run_id"]
    assert record["provenance"]["script"] == "rollout-lab bench trainer-loop" and record["provenance"]["argv"] == argv
    assert record["config"]["tiny"] == "qwen2" and record["config"]["train_rows"] == 4
    assert [it["logprob_mismatch"]["max_abs"] for it in record["results"]["iterations"]] == [0, 0]
    assert (tmp_path / "trainer_loop.csv").read_text().splitlines()[0].startswith("run_id,iteration,git_sha")
    capsys.readouterr()
    monkeypatch.setattr("rollout_lab.cli.bench.build_model", lambda *a, **k: pytest.fail("a model was built"))
    assert main(["bench", "trainer-loop", *argv]) == 2
    assert "already exist" in capsys.readouterr().err
    for bad, message in ((["--lr", "-1"], "lr must be a number > 0, got -1.0"),
                         (["--train-mode", "both"], "train_mode must be one of ['toggle', 'eval'], got 'both'")):
        assert main(["bench", "trainer-loop", "--tiny", "qwen2", "--out", str(tmp_path / "x"), *bad]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and message in err
