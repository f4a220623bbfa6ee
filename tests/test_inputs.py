"""What a call may be given (issue 16's checks so far): bad inputs are a ValueError naming the
value, before any forward; and every sequence says why it finished."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import get_tiny, one_fast

from rollout_lab import Rollout, RolloutConfig
from rollout_lab.planner.cost import CostCoefficients


@pytest.mark.parametrize("kwargs, message", [
    (dict(do_sample=True, temperature=1e-44), "below 1e-05: the logits divided by it overflow fp32"),
    (dict(do_sample=True, temperature=1e-6, top_p=0.5), "use greedy decoding"),
    (dict(do_sample=True, seed=2**64), r"seed must be an int in \[0, 2\*\*64\)"),
    (dict(do_sample=True, seed=-1), r"seed must be an int in \[0, 2\*\*64\)"),
])
def test_sampling_settings_fail_before_any_forward(no_forward, kwargs, message):
    with pytest.raises(ValueError, match=message):
        Rollout(no_forward).generate([[1, 2]], max_new_tokens=2, **kwargs)


@pytest.mark.parametrize("ids", [torch.tensor([[1.5, 2.0]]), torch.tensor([[True, False]]),
                                 torch.tensor([[1.0, 2.0]])])
def test_float_and_bool_tensors_are_not_token_ids(no_forward, ids):
    with pytest.raises(ValueError, match="input_ids must be an integer tensor"):
        Rollout(no_forward).generate(ids, max_new_tokens=2)


def test_the_smallest_temperature_and_largest_seed_run():
    model = get_tiny("qwen2")
    result = Rollout(model).generate([[1, 2, 3]], max_new_tokens=3, do_sample=True, temperature=1e-5,
                                     seed=2**64 - 1)
    assert len(result.sequences[0]) == 3


META = torch.device("meta")


@pytest.mark.parametrize("kwargs, message", [  # issue 36: each passed the checks, then raised elsewhere
    (dict(do_sample=True, seed=np.int64(3)), r"seed must be an int in \[0, 2\*\*64\) or None, got np.int64\(3\) "
                                             r"\(pass int\(seed\)\)"),
    (dict(do_sample=True, seed=np.uint64(2**64 - 1)), "seed must be an int in"),
    (dict(do_sample=True, seed=torch.tensor(5)), r"seed must be .*got tensor\(5\)"),
    (dict(max_new_tokens={2: 2}), r"max_new_tokens must be an int >= 1, or a list of one int >= 1 per request; "
                                  r"got \{2: 2\}"),
    (dict(max_new_tokens={2}), r"or a list of one int >= 1 per request; got \{2\}"),
    (dict(max_new_tokens=torch.tensor(5.0)), r"max_new_tokens must be an int >= 1.*got tensor\(5\.\)"),
    (dict(max_new_tokens=torch.tensor([[2]])), r"got tensor\(\[\[2\]\]\)"),
    (dict(max_new_tokens=torch.tensor([2], device=META)), "max_new_tokens .* is on the meta device"),
    (dict(max_new_tokens=np.uint64(2**64 - 1)), r"max_new_tokens must be an int >= 1 and <= 2\*\*63 - 1"),
    (dict(do_sample=True, temperature=torch.tensor(5.0)), r"temperature must be .*got tensor\(5\.\)"),
    (dict(do_sample=True, top_p=torch.tensor(0.5)), "top_p must be a number"),
    (dict(do_sample=True, top_k=torch.tensor(5.0)), "top_k must be an int"),
    (dict(temperature=np.array([1.0, 2.0])), r"temperature=array\(\[1\., 2\.\]\) only apply to sampling"),
    (dict(prompts=torch.tensor([[1, 2]], device=META)), r"input_ids is on the meta device .*shape \(1, 2\)"),
    (dict(prompts=[torch.tensor([1, 2], device=META)]), "request 0: the prompt is on the meta device"),
    (dict(prompts=[[torch.tensor(1, device=META)]]), "request 0: token ids must be ints"),
    (dict(prompts=torch.tensor([[1, 2]]), attention_mask=torch.ones(1, 2, dtype=torch.long, device=META)),
     "attention_mask is on the meta device"),
])
def test_numbers_of_another_kind_are_one_value_error_before_any_forward(no_forward, kwargs, message):
    call = {"prompts": [[1, 2], [3]], "max_new_tokens": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        Rollout(no_forward, RolloutConfig(mode="aligned")).generate(call.pop("prompts"), **call)


def test_numpy_and_tensor_ints_are_used_as_python_ints(oracle):
    """Accepted where an int is expected, and converted: a numpy int kept as it came overflows later,
    and an EOS id kept as a tensor hashes by identity, so it never stopped a row."""
    model = get_tiny("qwen2")
    prompts = [[5, 9, 2], [7, 4]]
    eos = oracle(model, prompts[:1], max_new_tokens=4)[0][1]
    config = RolloutConfig(mode="aligned", eos_token_id=torch.tensor(eos), pad_token_id=np.int64(0),
                           continuous_batch_size=torch.tensor(2), cache_capacity=np.int64(64),
                           kv_block_size=np.int64(32), decode_widths=torch.tensor(4))
    for name in ("eos_token_id", "pad_token_id", "continuous_batch_size", "cache_capacity", "kv_block_size",
                 "decode_widths"):
        assert type(getattr(config, name)) is int, name
    assert RolloutConfig(eos_token_id=[np.int64(eos), torch.tensor(1)]).eos_token_id == [eos, 1]
    rollout = Rollout(model, config)
    result = rollout.generate(prompts, max_new_tokens=np.array([4, 3]))
    assert result.finish_reasons[0] == "stop" and result.sequences[0][-1] == eos
    assert rollout.generate(prompts, max_new_tokens=torch.tensor(4)).sequences[0] == result.sequences[0]


@pytest.mark.parametrize("field, value, message", [
    ("cache_capacity", 2**70, r"cache_capacity must be an int >= 1 and <= 2\*\*63 - 1, or None, got"),
    ("kv_cache_tokens", np.uint64(2**64 - 1), r"kv_cache_tokens must be an int >= 1 and <= 2\*\*63 - 1"),
    ("continuous_batch_size", torch.tensor(2, device=META), "continuous_batch_size must be an int >= 1, or None"),
    ("decode_widths", 2**70, "decode_widths must be an int >= 1 and <= 4096"),  # its ladder looped 2**70 times
    ("max_decode_graphs", torch.tensor(True), "max_decode_graphs must be an int >= 1"),
    ("pad_token_id", torch.tensor(1, device=META), "pad_token_id must be an int >= 0, or None"),
    ("eos_token_id", 2**70, r"eos_token_id must be an int >= 0 and <= 2\*\*63 - 1"),
    ("kv_block_size", torch.tensor(64.0), r"kv_block_size must be one of \[16, 32, 64, 128\], got tensor\(64\.\)"),
])
def test_config_ints_without_a_value_or_out_of_range_are_refused(field, value, message):
    with pytest.raises(ValueError, match=message):
        RolloutConfig(**{field: value})


@pytest.mark.parametrize("model, lacks", [
    (torch.nn.Linear(2, 2), "lacks a transformers config (model.config), get_input_embeddings()"),
    (object(), "parameters"),
])
def test_a_model_that_is_not_a_causal_lm_is_named(model, lacks):
    with pytest.raises(ValueError, match="Rollout needs a Hugging Face causal LM") as err:
        Rollout(model)
    assert lacks in str(err.value) and type(model).__name__ in str(err.value)


def test_coefficients_that_overflow_are_refused():
    with pytest.raises(ValueError, match="prefill_fixed_cost_ms=1e\\+300 is over 1e\\+12 ms per unit"):
        CostCoefficients(prefill_fixed_cost_ms=1e300)
    CostCoefficients(prefill_token_cost_ms=1e12)  # the bound itself is accepted


@pytest.mark.parametrize("mode", ["nocb", "bucketed", "packed"])
def test_finish_reasons(mode, oracle):
    model = get_tiny("qwen3")
    prompts = [[5, 9, 2], [7], [3, 3, 8, 1], [11, 4]]
    free = oracle(model, prompts, max_new_tokens=8)
    eos = free[0][2]  # the third token of the first request: it stops there
    budgets = [8, 1, 6, 8]
    config = RolloutConfig(mode=mode, eos_token_id=eos, continuous_batch_size=None if mode == "nocb" else 2)
    result = Rollout(model, config).generate(prompts, max_new_tokens=budgets)
    assert len(result.finish_reasons) == len(result.sequences) == 4
    for seq, budget, reason in zip(result.sequences, budgets, result.finish_reasons):
        assert reason == ("stop" if seq[-1] == eos else "length")
        assert reason == "stop" or len(seq) == budget
    assert result.finish_reasons[0] == "stop" and result.finish_reasons[1] == "length"
    none = Rollout(model, RolloutConfig(mode=mode)).generate(prompts, max_new_tokens=3)
    assert none.finish_reasons == ["length"] * 4  # no EOS: every row runs its budget


# ---------------------------------------------------------------- EOS follows the model

def _with_model_eos(family, oracle):
    """A tiny model (a fresh copy) whose generation_config names, as EOS, a token it emits mid-sequence."""
    from transformers import GenerationConfig

    from rollout_lab.measure.models import tiny_model

    model = tiny_model(family, seed=0)
    prompts = [[5, 9, 2], [7], [3, 3, 8, 1]]
    free = oracle(model, prompts, max_new_tokens=12)
    eos = free[0][3]
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=0)
    return model, prompts, eos


@pytest.mark.parametrize("family", one_fast(["qwen2", "llama"], "qwen2"))
def test_the_models_eos_stops_rows_where_hf_generate_does(family, oracle):
    model, prompts, eos = _with_model_eos(family, oracle)
    expected = []
    for prompt in prompts:  # HF generate with the model's own generation_config
        out = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
        expected.append(out[0, len(prompt):].tolist())
    expected = [s[: s.index(eos) + 1] if eos in s else s for s in expected]
    assert any(len(s) < 12 for s in expected)  # the model's EOS really cuts a row
    for mode in ("nocb", "bucketed", "packed"):
        result = Rollout(model, RolloutConfig(mode=mode)).generate(prompts, max_new_tokens=12)
        assert result.sequences == expected, mode
        assert result.finish_reasons == ["stop" if s[-1] == eos else "length" for s in expected]
    ignored = Rollout(model, RolloutConfig(ignore_eos=True)).generate(prompts, max_new_tokens=12)
    assert [len(s) for s in ignored.sequences] == [12, 12, 12]
    other = Rollout(model, RolloutConfig(eos_token_id=[])).generate(prompts, max_new_tokens=12)
    assert other.sequences == ignored.sequences  # an explicit (empty) list overrides the model's


def test_eos_settings_are_checked_and_the_pad_falls_back_to_the_models_eos(oracle):
    with pytest.raises(ValueError, match="ignore_eos=True conflicts with eos_token_id=3"):
        RolloutConfig(ignore_eos=True, eos_token_id=3)
    with pytest.raises(ValueError, match="ignore_eos must be a bool"):
        RolloutConfig(ignore_eos=1)
    model, _, eos = _with_model_eos("qwen3", oracle)
    assert Rollout(model).pad_token_id == 0  # the generation_config's pad
    model.generation_config.pad_token_id = 7
    assert Rollout(model).pad_token_id == 7  # it wins over the config's, as in HF generate
    model.generation_config.pad_token_id = None
    model.config.pad_token_id = None
    rollout = Rollout(model)
    assert rollout.eos_token_ids == (eos,) and rollout.pad_token_id == eos  # then the first EOS
    assert Rollout(model, RolloutConfig(ignore_eos=True)).eos_token_ids == ()


# ---------------------------------------------------------------- tensors, masks, BatchEncoding

PROMPTS = [[5, 9, 2, 4], [7], [3, 3, 8]]


def _padded(prompts, side, pad=0):
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        cols = slice(width - len(p), width) if side == "left" else slice(0, len(p))
        ids[row, cols], mask[row, cols] = torch.tensor(p), 1
    return ids, mask


@pytest.mark.parametrize("mode", ["nocb", "bucketed", "packed"])
def test_every_input_form_gives_the_same_tokens(mode):
    from transformers import BatchEncoding

    rollout = Rollout(get_tiny("llama"), RolloutConfig(mode=mode))
    expected = rollout.generate(PROMPTS, max_new_tokens=4).sequences
    for side in ("left", "right"):
        ids, mask = _padded(PROMPTS, side)
        assert rollout.generate(ids, attention_mask=mask, max_new_tokens=4).sequences == expected, side
        assert rollout.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4).sequences == expected
        encoding = BatchEncoding({"input_ids": ids, "attention_mask": mask})
        assert rollout.generate(encoding, max_new_tokens=4).sequences == expected
        plain = {"input_ids": ids.tolist(), "attention_mask": mask.tolist()}  # a tokenizer without tensors
        assert rollout.generate(plain, max_new_tokens=4).sequences == expected
        assert rollout.generate(ids, max_new_tokens=4).sequences == expected  # mask inferred from pad 0


def test_input_form_errors_before_any_forward(no_forward):
    rollout = Rollout(no_forward)
    ids, mask = _padded(PROMPTS, "right")
    cases = [
        (dict(prompts=ids, input_ids=ids), "not both"),
        (dict(), "not neither"),
        (dict(prompts={"attention_mask": mask}), "needs 'input_ids'"),
        (dict(prompts={"input_ids": ids, "attention_mask": mask}, attention_mask=mask), "given twice"),
        (dict(prompts=ids, attention_mask=mask[:, :2]), "shape of input_ids"),
        (dict(prompts=ids, attention_mask=mask * 2), "other than 0 and 1"),
        (dict(prompts=ids, attention_mask=mask.float()), "0 and 1 as ints or bools"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            rollout.generate(max_new_tokens=2, **kwargs)


def test_a_pad_id_that_is_also_eos_is_ambiguous(no_forward):
    ids, mask = _padded(PROMPTS, "left", pad=2)
    rollout = Rollout(no_forward, RolloutConfig(pad_token_id=2, eos_token_id=2))
    with pytest.raises(ValueError, match="pad id 2, which is also an EOS id"):
        rollout.generate(ids, max_new_tokens=2)


# ---------------------------------------------------------------- generation_config=

def test_a_generation_config_is_honoured():
    from transformers import GenerationConfig

    model = get_tiny("qwen2")
    rollout = Rollout(model)
    free = rollout.generate(PROMPTS, max_new_tokens=8).sequences
    eos = free[0][2]
    gc = GenerationConfig(max_new_tokens=8, do_sample=True, temperature=0.7, top_k=20, top_p=0.9,
                          repetition_penalty=1.3, eos_token_id=eos, pad_token_id=0, num_return_sequences=2)
    got = rollout.generate(PROMPTS, generation_config=gc, seed=5)
    config = RolloutConfig(repetition_penalty=1.3, eos_token_id=eos, pad_token_id=0)
    expected = Rollout(model, config).generate(PROMPTS, max_new_tokens=8, do_sample=True, temperature=0.7,
                                               top_k=20, top_p=0.9, num_samples=2, seed=5)
    assert got.sequences == expected.sequences and got.num_samples == 2
    assert rollout.config.repetition_penalty == 1.0 and rollout.config.eos_token_id is None  # this call only
    greedy = rollout.generate(PROMPTS, generation_config=GenerationConfig(max_new_tokens=8))
    assert greedy.sequences == free


@torch.no_grad()
def _ranks(model, prompts, sequences) -> list[int]:
    """Each token's rank among its step's logits (0: the largest), by a teacher-forced forward."""
    ranks = []
    for prompt, seq in zip(prompts, sequences):
        logits = model(input_ids=torch.tensor([prompt + seq[:-1]])).logits[0, len(prompt) - 1:]  # [len(seq), vocab]
        ranks += [int((row > row[token]).sum()) for row, token in zip(logits, seq)]
    return ranks


@pytest.mark.slow  # sampled calls on two routes
def test_a_sampling_generation_config_keeps_hfs_default_top_k():
    """GenerationConfig(do_sample=True) samples as HF does: with top_k=50 unless it or the call says otherwise."""
    from transformers import GenerationConfig

    from rollout_lab.engine.api.call import HF_SAMPLING_DEFAULTS

    model = get_tiny("qwen2")
    rollout = Rollout(model)
    rows = [p for p in PROMPTS for _ in range(8)]
    sample = dict(max_new_tokens=16, do_sample=True, seed=11, num_samples=8)
    got = rollout.generate(PROMPTS, generation_config=GenerationConfig(do_sample=True, max_new_tokens=16),
                           seed=11, num_samples=8)
    assert got.sequences == rollout.generate(PROMPTS, top_k=50, **sample).sequences
    assert max(_ranks(model, rows, got.sequences)) < 50
    unfiltered = rollout.generate(PROMPTS, **sample)  # rollout_lab's own default: no top-k
    assert max(_ranks(model, rows, unfiltered.sequences)) >= 50  # so the check above can fail
    off = GenerationConfig(do_sample=True, top_k=0, max_new_tokens=16)
    assert rollout.generate(PROMPTS, generation_config=off, seed=11, num_samples=8).sequences == unfiltered.sequences
    own = rollout.generate(PROMPTS, generation_config=GenerationConfig(do_sample=True, max_new_tokens=16),
                           top_k=5, seed=11, num_samples=8)  # the call's own top_k wins over the default
    assert own.sequences == rollout.generate(PROMPTS, top_k=5, **sample).sequences
    defaults = getattr(GenerationConfig, "_get_default_generation_params", None)
    if defaults is not None:  # transformers >= 5 keeps them there; earlier ones on every instance
        assert {name: defaults()[name] for name in HF_SAMPLING_DEFAULTS} == HF_SAMPLING_DEFAULTS


@pytest.mark.parametrize("gc_kwargs, call, message", [
    (dict(num_beams=2, max_new_tokens=4), {}, "num_beams=2, which rollout_lab does not support"),
    (dict(no_repeat_ngram_size=3, max_new_tokens=4), {}, "no_repeat_ngram_size=3"),
    (dict(stop_strings=["x"], max_new_tokens=4), {}, "stop_strings"),
    (dict(max_length=30), {}, "give max_new_tokens instead"),
    (dict(max_new_tokens=4, do_sample=True, temperature=0.5), dict(temperature=0.9, do_sample=True),
     "temperature is set twice"),
    (dict(), {}, "max_new_tokens is required"),
])
def test_generation_config_errors_before_any_forward(no_forward, gc_kwargs, call, message):
    from transformers import GenerationConfig

    with pytest.raises(ValueError, match=message):
        Rollout(no_forward).generate(PROMPTS, generation_config=GenerationConfig(**gc_kwargs), **call)
    with pytest.raises(ValueError, match="must be a transformers.GenerationConfig"):
        Rollout(no_forward).generate(PROMPTS, generation_config={"max_new_tokens": 3})


# ---------------------------------------------------------------- text in, text out

def test_text_and_chat_prompts_with_a_tokenizer(tokenizer):
    model = get_tiny("qwen3")
    ids = Rollout(model).generate(PROMPTS, max_new_tokens=4).sequences
    rollout = Rollout(model, tokenizer=tokenizer)
    texts = [" ".join(f"w{t}" for t in p) for p in PROMPTS]
    result = rollout.generate(texts, max_new_tokens=4)
    assert result.sequences == ids
    assert result.texts == tokenizer.batch_decode(ids, skip_special_tokens=True)
    assert result.texts[0] == " ".join(f"w{t}" for t in ids[0] if t != 2)  # w2 is the special EOS
    batch = rollout.generate(tokenizer(texts, padding=True, return_tensors="pt"), max_new_tokens=4)
    assert batch.sequences == ids  # a BatchEncoding straight from the tokenizer
    chats = [[{"role": "user", "content": t}] for t in texts]
    chat = rollout.generate(chats, apply_chat_template=True, max_new_tokens=4)
    expected = Rollout(model).generate([[3, *p, 4] for p in PROMPTS], max_new_tokens=4).sequences
    assert chat.sequences == expected
    assert Rollout(model).generate(PROMPTS, max_new_tokens=2).texts is None  # no tokenizer: no texts


def test_text_errors(no_forward, tokenizer):
    with pytest.raises(ValueError, match="text prompts need a tokenizer"):
        Rollout(no_forward).generate(["w5 w6"], max_new_tokens=2)
    with pytest.raises(ValueError, match="prompts is one string"):
        Rollout(no_forward, tokenizer=tokenizer).generate("w5 w6", max_new_tokens=2)
    with pytest.raises(ValueError, match="takes a list of conversations"):
        Rollout(no_forward, tokenizer=tokenizer).generate(["w5"], apply_chat_template=True, max_new_tokens=2)
    with pytest.raises(ValueError, match="tokenizer must be a transformers tokenizer"):
        Rollout(no_forward, tokenizer=object())


def test_sample_and_beam_counts_of_any_kind_are_one_value_error():
    """issue 36's leftovers: 10**20 samples hung, a numpy array of beams raised numpy's truth-value error."""
    import numpy as np
    from conftest import get_tiny

    from rollout_lab import Rollout

    rollout = Rollout(get_tiny("qwen2"))
    with pytest.raises(ValueError, match=r"num_samples must be an int in \[1, 65536\], got 100000000000000000000"):
        rollout.generate([[1, 2]], max_new_tokens=2, num_samples=10**20)
    with pytest.raises(ValueError, match="num_beams=array"):
        rollout.generate([[1, 2]], max_new_tokens=2, num_beams=np.array([1, 1]))
    assert rollout.generate([[1, 2]], max_new_tokens=2, num_beams=np.int64(1)).sequences
