"""``Rollout.generate`` as HF and vLLM users call it: a model's own ``generation_config``,
``temperature=0``, ``logprobs_mode`` without ``return_logprobs``, a model left in train mode, and
the progress bar (``engine.sched.progress``). Tiny fp32 models, CPU."""
from __future__ import annotations

import io

import pytest
import torch
from conftest import get_tiny
from transformers import AutoModelForCausalLM, GenerationConfig

from rollout_lab import Rollout, RolloutConfig
from rollout_lab.engine.sample.processors import LOGPROB_MODES
from rollout_lab.engine.sched import progress as progress_module
from rollout_lab.engine.sched.progress import CallProgress, shows_progress
from rollout_lab.measure.models import tiny_config

PROMPTS = [[5, 9, 2, 4], [7], [3, 3, 8]]


# ---------------------------------------------------------------- generation_config=

def test_a_models_own_generation_config_is_accepted(family):
    """transformers 5's to_diff_dict lists output_attentions=False and output_hidden_states=False, the
    model config's defaults: they ask nothing, so the call runs as without the config."""
    model = get_tiny(family)
    rollout = Rollout(model)
    expected = rollout.generate(PROMPTS, max_new_tokens=6).sequences
    for config in (model.generation_config, GenerationConfig.from_model_config(model.config)):
        assert "output_attentions" in config.to_diff_dict()  # what the check must see through
        assert rollout.generate(PROMPTS, generation_config=config, max_new_tokens=6).sequences == expected


@pytest.mark.parametrize("changes, named, supported", [
    (dict(output_attentions=True), "output_attentions=True", "output_hidden_states"),
    (dict(num_beams=2, output_hidden_states=True), "num_beams=2, output_hidden_states=True", "output_attentions"),
])
def test_a_generation_config_is_refused_for_what_it_sets_only(no_forward, changes, named, supported):
    config = GenerationConfig.from_model_config(no_forward.config)
    for name, value in changes.items():
        setattr(config, name, value)
    with pytest.raises(ValueError, match="which rollout_lab does not support; supported: max_new_tokens") as error:
        Rollout(no_forward).generate(PROMPTS, generation_config=config, max_new_tokens=4)
    assert f"generation_config sets {named}," in str(error.value)
    assert supported not in str(error.value)  # left at its default: not named


# ---------------------------------------------------------------- temperature=0

def test_temperature_zero_is_greedy_without_do_sample():
    rollout = Rollout(get_tiny("qwen2"))
    greedy = rollout.generate(PROMPTS, max_new_tokens=12)
    for call in (dict(temperature=0), dict(temperature=0.0, top_p=0.9, seed=3),
                 dict(temperature=0.0, do_sample=True),
                 dict(generation_config=GenerationConfig(temperature=0.0))):
        got = rollout.generate(PROMPTS, max_new_tokens=12, **call)
        assert got.sequences == greedy.sequences and got.seed is None, call
    with pytest.raises(ValueError, match=r"temperature=0.7 only apply to sampling: pass do_sample=True"):
        rollout.generate(PROMPTS, max_new_tokens=2, temperature=0.7)
    with pytest.raises(ValueError, match=r"top_p must be a number in \(0, 1\] \(1 = off\), got 1.5"):  # still checked
        rollout.generate(PROMPTS, max_new_tokens=2, temperature=0, top_p=1.5)


# ---------------------------------------------------------------- logprobs_mode without return_logprobs

@pytest.mark.parametrize("mode", LOGPROB_MODES)
def test_a_logprobs_mode_without_return_logprobs_is_an_error(no_forward, mode):
    with pytest.raises(ValueError, match=rf"logprobs_mode='{mode}' .*: pass return_logprobs=True"):
        Rollout(no_forward).generate(PROMPTS, max_new_tokens=2, logprobs_mode=mode)


def test_return_logprobs_alone_returns_the_raw_ones():
    rollout = Rollout(get_tiny("qwen2"))
    plain = rollout.generate(PROMPTS, max_new_tokens=4, return_logprobs=True)
    raw = rollout.generate(PROMPTS, max_new_tokens=4, return_logprobs=True, logprobs_mode="raw")
    assert plain.logprobs == raw.logprobs and rollout.generate(PROMPTS, max_new_tokens=4).logprobs is None


# ---------------------------------------------------------------- eval mode for the call

def _dropout_model() -> torch.nn.Module:
    """The tiny OPT with dropout 0.3, left in train mode, its first decoder layer in eval mode."""
    config = tiny_config("opt")
    config.dropout = 0.3
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.2)
    model.generation_config.eos_token_id = None
    model.train()
    model.model.decoder.layers[0].eval()
    return model


def _flags(model: torch.nn.Module) -> list[bool]:
    return [module.training for module in model.modules()]


@pytest.mark.parametrize("mode", ["nocb", "aligned"])
def test_generate_runs_in_eval_mode_and_restores_each_modules_mode(mode):
    model = _dropout_model()
    before = _flags(model)
    rollout = Rollout(model, RolloutConfig(mode=mode))
    call = dict(max_new_tokens=8, return_logprobs=True, logprobs_mode="trainer")
    in_train = rollout.generate(PROMPTS, **call)
    assert _flags(model) == before and model.training and not model.model.decoder.layers[0].training
    model.eval()
    in_eval = rollout.generate(PROMPTS, **call)
    assert in_train.sequences == in_eval.sequences
    assert in_train.logprobs == in_eval.logprobs  # the "trainer" recompute in eval mode too


def test_eval_mode_is_restored_when_the_call_raises(monkeypatch):
    model = _dropout_model()
    before = _flags(model)
    seen = []

    def failing_run(self, spec, **kwargs):
        seen.append(_flags(self.model))
        raise RuntimeError("mid-call")

    monkeypatch.setattr(Rollout, "_run", failing_run)
    with pytest.raises(RuntimeError, match="mid-call"):
        Rollout(model).generate(PROMPTS, max_new_tokens=2)
    assert seen == [[False] * len(before)] and _flags(model) == before


# ---------------------------------------------------------------- the progress bar

@pytest.fixture
def no_delay(monkeypatch):
    """Bars drawn at once (a call here is far shorter than DELAY_S), and no CI variable to hide them."""
    monkeypatch.setattr(progress_module, "DELAY_S", 0)
    monkeypatch.delenv("CI", raising=False)


@pytest.mark.parametrize("config", [dict(mode="nocb"), dict(mode="aligned"),
                                    dict(mode="paged", continuous_batch_size=2)])
def test_progress_true_draws_a_bar_that_ends_at_the_tokens_generated(no_delay, capsys, monkeypatch, config):
    ends = []
    close = CallProgress.close

    def recording_close(self):
        close(self)
        ends.append((self.bar.n, self.bar.total))

    monkeypatch.setattr(CallProgress, "close", recording_close)
    model = get_tiny("qwen2")
    free = Rollout(model).generate(PROMPTS, max_new_tokens=10).sequences
    eos = free[0][3]  # row 0 stops early: the bar's total drops by its unused budget
    result = Rollout(model, RolloutConfig(eos_token_id=eos, **config)).generate(
        PROMPTS, max_new_tokens=[10, 6, 12], progress=True)
    err = capsys.readouterr().err
    assert "generate" in err and "tok" in err
    generated = sum(map(len, result.sequences))
    assert generated < 28 and ends == [(generated, generated)]


def test_progress_false_and_auto_without_a_terminal_draw_nothing(no_delay, capsys):
    rollout = Rollout(get_tiny("qwen2"))
    rollout.generate(PROMPTS, max_new_tokens=4, progress=False)
    rollout.generate(PROMPTS, max_new_tokens=4)  # auto: pytest's stderr is no terminal
    Rollout(get_tiny("qwen2"), RolloutConfig(progress=True)).generate(PROMPTS, max_new_tokens=4, progress=False)
    assert capsys.readouterr().err == ""
    Rollout(get_tiny("qwen2"), RolloutConfig(progress=True)).generate(PROMPTS, max_new_tokens=4)
    assert "generate" in capsys.readouterr().err


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_auto_progress_is_on_at_a_terminal_unless_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    assert shows_progress(None) is False  # pytest's stderr
    monkeypatch.setattr("sys.stderr", _Terminal())
    assert shows_progress(None) is True
    monkeypatch.setenv("CI", "true")
    assert shows_progress(None) is False and shows_progress(True) is True
    assert shows_progress(False) is False


def test_progress_must_be_a_bool_or_none(no_forward):
    with pytest.raises(ValueError, match="progress must be True, False or None .*, got 'yes'"):
        Rollout(no_forward).generate(PROMPTS, max_new_tokens=2, progress="yes")
    with pytest.raises(ValueError, match="progress must be True, False or None .*, got 1"):
        RolloutConfig(progress=1)
