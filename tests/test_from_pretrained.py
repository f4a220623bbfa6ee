"""``Rollout.from_pretrained`` and the CLI's ``--model``: one loader (``engine.api.loading``), one set of
one-line errors, and the same tokens as ``Rollout(model)`` on the same weights."""
from __future__ import annotations

import json

import huggingface_hub.constants
import pytest
import torch
from transformers import ViTConfig

from rollout_lab.cli.main import build_parser, main
from rollout_lab.cli.model import build_model, resolve_model_arguments
from rollout_lab.engine.api.loading import TOKENIZER_FILES, load_model_and_tokenizer
from rollout_lab.engine.api.rollout import Rollout
from rollout_lab.measure.models import TINY_FAMILIES
from rollout_lab.measure.presets import PRESETS, geometry_for
from conftest import get_tiny

PROMPTS = [[5, 6, 7], [8], [9, 10, 11, 12, 13]]


def one_line(err: BaseException) -> str:
    text = str(err)
    assert "\n" not in text, text
    return text


def save(model, folder, tokenizer=None):
    model.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory, tokenizer):
    """The tiny llama and the tests' WordLevel tokenizer, saved as save_pretrained saves them (a llama:
    for a qwen2 folder transformers' AutoTokenizer builds Qwen2Tokenizer whatever tokenizer_class says)."""
    return save(get_tiny("llama"), tmp_path_factory.mktemp("tiny-llama"), tokenizer)


@pytest.fixture(scope="module")
def bare_folder(tmp_path_factory):
    """The tiny qwen2 saved without a tokenizer."""
    return save(get_tiny("qwen2"), tmp_path_factory.mktemp("bare"))


@pytest.fixture
def offline_hub(monkeypatch, tmp_path):
    """No hub here: offline mode and an empty hub cache (as a machine without network that never fetched)."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_a_saved_folder_generates_what_the_model_does(family, tmp_path):
    model = get_tiny(family)
    path = save(model, tmp_path / family)
    loaded = Rollout.from_pretrained(path, dtype="float32", device="cpu", mode="aligned")
    assert loaded.tokenizer is None and loaded.config.mode == "aligned"
    expected = Rollout(model).generate(PROMPTS, max_new_tokens=6).sequences
    assert loaded.generate(PROMPTS, max_new_tokens=6).sequences == expected
    assert loaded.model.config.name_or_path == str(path)  # the name a cost file is checked against


def test_text_prompts_use_the_folders_tokenizer(folder, tokenizer):
    rollout = Rollout.from_pretrained(str(folder), dtype=torch.float32, device=torch.device("cpu"))
    assert rollout.tokenizer is not None and rollout.tokenizer("w5 w6 w7")["input_ids"] == [5, 6, 7]
    by_text = rollout.generate(["w5 w6 w7", "w8"], max_new_tokens=4)
    by_ids = Rollout(get_tiny("llama")).generate([[5, 6, 7], [8]], max_new_tokens=4)
    assert by_text.sequences == by_ids.sequences
    assert by_text.texts == tokenizer.batch_decode(by_ids.sequences, skip_special_tokens=True)


def test_a_folder_without_a_tokenizer_takes_token_ids(bare_folder):
    rollout = Rollout.from_pretrained(bare_folder, dtype="float32", device="cpu")
    assert rollout.tokenizer is None
    assert rollout.generate(PROMPTS, max_new_tokens=2).texts is None
    with pytest.raises(ValueError, match="text prompts need a tokenizer"):
        rollout.generate(["w5 w6"], max_new_tokens=2)


def test_tokenizer_argument(folder, bare_folder, tokenizer):
    _, none = load_model_and_tokenizer(folder, dtype="float32", device="cpu", tokenizer=False)
    assert none is None
    _, other = load_model_and_tokenizer(bare_folder, dtype="float32", device="cpu", tokenizer=str(folder))
    assert other("w9")["input_ids"] == [9]
    _, same = load_model_and_tokenizer(bare_folder, dtype="float32", device="cpu", tokenizer=tokenizer)
    assert same is tokenizer
    with pytest.raises(TypeError, match="tokenizer must be a transformers tokenizer, a path or hub name"):
        load_model_and_tokenizer(bare_folder, device="cpu", tokenizer=3)
    with pytest.raises(ValueError, match=f"tokenizer {str(bare_folder)!r} has no tokenizer files") as err:
        load_model_and_tokenizer(folder, device="cpu", tokenizer=str(bare_folder))
    assert all(name in str(err.value) for name in TOKENIZER_FILES)


def test_dtype_and_device_defaults_and_names(bare_folder):
    model, _ = load_model_and_tokenizer(bare_folder, device="cpu")
    assert next(model.parameters()).dtype == torch.float32  # CPU default
    model, _ = load_model_and_tokenizer(bare_folder, dtype="bfloat16", device="cpu")
    assert next(model.parameters()).dtype == torch.bfloat16
    model, _ = load_model_and_tokenizer(bare_folder, dtype="auto", device="cpu")
    assert next(model.parameters()).dtype == torch.float32  # as saved
    assert not model.training


def test_bad_values_fail_before_the_weights_load(bare_folder, monkeypatch):
    monkeypatch.setattr("rollout_lab.engine.api.loading.AutoModelForCausalLM.from_pretrained",
                        lambda *a, **k: pytest.fail("the weights were read"))
    with pytest.raises(ValueError, match="'modes' is not a RolloutConfig field; valid fields: mode, ") as err:
        Rollout.from_pretrained(bare_folder, device="cpu", modes="aligned")
    one_line(err.value)
    with pytest.raises(ValueError, match="mode must be one of"):
        Rollout.from_pretrained(bare_folder, device="cpu", mode="fastest")
    with pytest.raises(ValueError, match=r"dtype must be 'auto', a floating torch dtype or its name .*'bfloat16'.*"
                                         r"got 'int8'"):
        Rollout.from_pretrained(bare_folder, dtype="int8", device="cpu")
    with pytest.raises(ValueError, match="got torch.int64"):
        Rollout.from_pretrained(bare_folder, dtype=torch.int64, device="cpu")
    with pytest.raises(ValueError, match=r"device must be 'cpu' or 'cuda\[:N\]', got 'gpu'"):
        Rollout.from_pretrained(bare_folder, device="gpu")
    with pytest.raises(TypeError, match="device must be a string or a torch.device, got int"):
        Rollout.from_pretrained(bare_folder, device=0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device='cuda' but CUDA is not available here; use device='cpu'"):
            Rollout.from_pretrained(bare_folder, device="cuda")


def test_path_errors_name_the_path_and_what_would_be_valid(tmp_path, monkeypatch):
    monkeypatch.setattr("rollout_lab.engine.api.loading.snapshot_download",
                        lambda *a, **k: pytest.fail("a path went to the hub"))
    missing = str(tmp_path / "missing")
    with pytest.raises(ValueError, match=f"no model folder at {missing!r}; expected a folder written by "
                                         r"save_pretrained \(config.json, model.safetensors\) or a Hugging Face "
                                         "hub name such as 'Qwen/Qwen2.5-0.5B'") as err:
        Rollout.from_pretrained(missing, device="cpu")
    one_line(err.value)
    for name in ("./missing", "a/b/c", "my model"):
        with pytest.raises(ValueError, match=f"no model folder at {name!r}"):
            Rollout.from_pretrained(name, device="cpu")
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(ValueError, match="'.*file.txt' is a file, not a model folder"):
        Rollout.from_pretrained(tmp_path / "file.txt", device="cpu")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=f"{str(tmp_path / 'empty')!r} has no config.json, so it is not a model "
                                         "folder; expected a folder written by save_pretrained"):
        Rollout.from_pretrained(tmp_path / "empty", device="cpu")
    with pytest.raises(TypeError, match="model must be a path or a hub name"):
        Rollout.from_pretrained(get_tiny("qwen2"), device="cpu")


def test_a_config_that_is_not_a_causal_lm(tmp_path):
    ViTConfig().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=f"{str(tmp_path)!r} holds a 'vit' model, which is not a causal LM: "
                                         "expected a model type AutoModelForCausalLM loads, such as llama") as err:
        Rollout.from_pretrained(tmp_path, device="cpu")
    one_line(err.value)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "not-a-model"}))
    with pytest.raises(ValueError, match=f"the config.json of {str(tmp_path)!r} does not load: .*`not-a-model`"):
        Rollout.from_pretrained(tmp_path, device="cpu")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=f"the config.json of {str(tmp_path)!r} does not load: .*not a valid JSON"):
        Rollout.from_pretrained(tmp_path, device="cpu")


def test_pickled_weights_are_never_loaded(tmp_path):
    model = get_tiny("qwen2")
    model.config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"has no safetensors weights \(one of model.safetensors, "
                                         r"model.safetensors.index.json\); expected a folder"):
        Rollout.from_pretrained(tmp_path, device="cpu")
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="its pytorch_model.bin is pickled and never loaded: save the model again"):
        Rollout.from_pretrained(tmp_path, device="cpu")


def test_a_hub_name_without_a_hub_is_one_oserror(offline_hub, bare_folder):
    with pytest.raises(OSError, match="no model folder at 'Qwen/Qwen2.5-0.5B', and the Hugging Face hub cannot be "
                                      r"reached \(no connection, or HF_HUB_OFFLINE\) with no copy of "
                                      "'Qwen/Qwen2.5-0.5B' in its cache; expected a folder written by "
                                      "save_pretrained") as err:
        Rollout.from_pretrained("Qwen/Qwen2.5-0.5B", device="cpu")
    assert err.value.__suppress_context__  # not the hub's chained traceback
    one_line(err.value)
    with pytest.raises(OSError, match="no tokenizer folder at 'Qwen/Qwen2.5-0.5B', and the Hugging Face hub"):
        load_model_and_tokenizer(bare_folder, device="cpu", tokenizer="Qwen/Qwen2.5-0.5B")


# ---------------------------------------------------------------- the CLI's --model: the same loader

def test_cli_loads_a_model_folder_through_the_shared_loader(folder):
    args = build_parser().parse_args(["calibrate", "--model", str(folder), "--device", "cpu"])
    resolve_model_arguments(args)
    assert args.dtype == "float32"  # the loader's CPU default
    model, name = build_model(args)
    assert name == folder.name and next(model.parameters()).dtype == torch.float32
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, get_tiny("llama")(ids).logits)
    args = build_parser().parse_args(["calibrate", "--tiny", "opt", "--device", "cpu"])
    resolve_model_arguments(args)
    assert (args.dtype, build_model(args)[1]) == ("float32", "tiny-opt")  # --tiny as before


@pytest.mark.parametrize("command", ["calibrate", "sweep"])
def test_cli_model_errors_are_the_loaders_one_line(command, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("rollout_lab.cli.main.build_model", lambda *a, **k: pytest.fail("a model was built"))
    missing = str(tmp_path / "missing")
    assert main([command, "--model", missing, "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: no model folder at {missing!r}; expected a folder "
                                                   "written by save_pretrained"), err
    assert "hub" not in err  # the CLI takes local folders only
    ViTConfig().save_pretrained(tmp_path / "vit")
    assert main([command, "--model", str(tmp_path / "vit"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds a 'vit' model, which is not a causal LM" in err, err
    assert main([command, "--model", "Qwen/Qwen2.5-0.5B", "--device", "cpu"]) == 2
    assert "error: no model folder at 'Qwen/Qwen2.5-0.5B'" in capsys.readouterr().err


def test_plan_tells_a_missing_folder_from_an_unknown_preset(tmp_path, capsys):
    missing = str(tmp_path / "nonexistent")
    assert main(["plan", "16", "--model", missing]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: no model folder at {missing!r}; expected a checkpoint "
                                                   f"folder (with config.json) or a preset, one of {sorted(PRESETS)}")
    assert main(["plan", "16", "--model", "gpt5"]) == 2
    assert capsys.readouterr().err.startswith(f"error: unknown preset 'gpt5'; expected one of {sorted(PRESETS)}")
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match=f"{str(tmp_path / 'f')!r} is a file, not a checkpoint folder"):
        geometry_for(str(tmp_path / "f"))
