"""Loading a model by name, as vLLM's ``LLM(model=...)`` and HF's ``from_pretrained`` do: a local
folder (what ``save_pretrained`` writes) read with no network at all, or a Hugging Face hub name
fetched into the hub cache first; then its config checked, its tokenizer and its weights loaded.
``Rollout.from_pretrained`` and the CLI's ``--model`` load through here, so both give the same
one-line errors: a ``ValueError`` naming the path and what would be valid, an ``OSError`` where the
hub cannot give a name.

    model, tokenizer = load_model_and_tokenizer("/ckpt/qwen2.5-0.5b", dtype="bfloat16", device="cuda")
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import snapshot_download
from huggingface_hub.errors import HFValidationError, HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError
from huggingface_hub.utils import validate_repo_id
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from rollout_lab.engine.api.config import RolloutConfig

# the weights are read from safetensors only: a pickled .bin can run code when it is loaded
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
# the files that hold a tokenizer's vocabulary: without one AutoTokenizer builds an empty tokenizer
# from the config's model type instead of failing, so their absence is checked here
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model")
# what a hub snapshot fetches: configs, the safetensors weights, the tokenizer; never code or .bin
MODEL_PATTERNS = ["*.json", "model*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"]
TOKENIZER_PATTERNS = ["*.json", "*.model", "*.txt", "*.tiktoken", "*.jinja"]
FOLDER = "a folder written by save_pretrained (config.json, model.safetensors)"
HUB_NAME = "a Hugging Face hub name such as 'Qwen/Qwen2.5-0.5B'"


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``device`` as a torch.device: None is cuda when CUDA is available, else cpu; a ValueError for
    anything but cpu or an existing cuda[:N]."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a string or a torch.device, got {type(device).__name__}")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        resolved = None
    if resolved is None or resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {str(device)!r}")
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={str(device)!r} but CUDA is not available here; use device='cpu'")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ValueError(f"device={str(device)!r} but this machine has {torch.cuda.device_count()} CUDA "
                             f"device(s): cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return resolved


def default_dtype(device: torch.device) -> torch.dtype:
    """The dtype a model is loaded in when none is given: bfloat16 on CUDA (half the memory and the
    tensor cores), float32 elsewhere (CPU matmuls in bfloat16 are slow, and the engine's CPU checks
    are made in float32)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype | str:
    """``dtype`` as ``from_pretrained`` takes it: a floating torch dtype, "auto" (the checkpoint's own,
    from its config.json, as HF reads it), or None for ``default_dtype(device)``."""
    if dtype is None:
        return default_dtype(device)
    if isinstance(dtype, str) and dtype == "auto":
        return dtype
    resolved = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ValueError(f"dtype must be 'auto', a floating torch dtype or its name (such as 'bfloat16', "
                         f"'float16', 'float32'), got {dtype!r}")
    return resolved


def rollout_config(fields: dict[str, Any]) -> RolloutConfig:
    """The RolloutConfig of keyword ``fields``; a ValueError listing the valid names for one that is
    not a field (``RolloutConfig``'s own checks then check the values)."""
    names = [field.name for field in dataclasses.fields(RolloutConfig)]
    unknown = sorted(set(fields) - set(names))
    if unknown:
        raise ValueError(f"{', '.join(map(repr, unknown))} {'is not a' if len(unknown) == 1 else 'are not'} "
                         f"RolloutConfig field{'' if len(unknown) == 1 else 's'}; valid fields: {', '.join(names)}")
    return RolloutConfig(**fields)


def is_hub_name(name: str) -> bool:
    """Whether ``name`` could be a hub repository ("name" or "namespace/name"), not a path."""
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def model_folder(name_or_path: str | os.PathLike, *, hub: bool = True, what: str = "model",
                 patterns: list[str] = MODEL_PATTERNS) -> Path:
    """The local folder of ``name_or_path``: itself when it is a folder, else (``hub``) the hub cache's
    snapshot of that hub name, fetched when the hub is reachable. A ValueError for a path that is not
    a folder, an OSError for a hub name the hub cannot give."""
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(f"{what} must be a path or a hub name (str), got {type(name_or_path).__name__}")
    shown = os.fspath(name_or_path)
    path = Path(shown).expanduser()
    if path.is_dir():
        return path
    valid = f"{FOLDER} or {HUB_NAME}" if hub else FOLDER
    if path.exists():
        raise ValueError(f"{shown!r} is a file, not a {what} folder; expected {valid}")
    if not (hub and is_hub_name(shown)):
        raise ValueError(f"no {what} folder at {shown!r}; expected {valid}")
    try:
        return Path(snapshot_download(shown, allow_patterns=patterns))
    except LocalEntryNotFoundError:  # offline (HF_HUB_OFFLINE), or no connection, and not cached
        raise OSError(f"no {what} folder at {shown!r}, and the Hugging Face hub cannot be reached (no "
                      f"connection, or HF_HUB_OFFLINE) with no copy of {shown!r} in its cache; expected "
                      f"{FOLDER}") from None
    except RepositoryNotFoundError:  # also a gated or private one without a login
        raise OSError(f"no {what} folder at {shown!r}, and the Hugging Face hub has no repository {shown!r} "
                      f"this login may read; expected {valid}") from None
    except (HfHubHTTPError, OSError) as err:
        raise OSError(f"no {what} folder at {shown!r}, and the Hugging Face hub did not give it: "
                      f"{first_line(err)}") from None


def read_causal_lm_config(folder: Path, *, shown: str) -> Any:
    """The transformers config of ``folder`` (called ``shown`` in errors): a ValueError when it has no
    config.json or no safetensors weights, or its model is not one AutoModelForCausalLM loads."""
    if not (folder / "config.json").is_file():
        raise ValueError(f"{shown!r} has no config.json, so it is not a model folder; expected {FOLDER}")
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as err:
        raise ValueError(f"the config.json of {shown!r} does not load: {first_line(err)}") from None
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(f"{shown!r} holds a {config.model_type!r} model, which is not a causal LM: expected "
                         "a model type AutoModelForCausalLM loads, such as llama, mistral, qwen2, qwen3, gemma, opt")
    if not any((folder / name).is_file() for name in WEIGHT_FILES):
        pickled = sorted(path.name for path in folder.glob("*.bin"))
        raise ValueError(f"{shown!r} has no safetensors weights (one of {', '.join(WEIGHT_FILES)})"
                         + (f"; its {', '.join(pickled)} is pickled and never loaded: save the model again "
                            "with save_pretrained" if pickled else f"; expected {FOLDER}"))
    return config


def check_model(name_or_path: str | os.PathLike, *, hub: bool = True) -> tuple[Path, Any]:
    """(folder, config) of a model by name: every check ``load_model_and_tokenizer`` makes before
    it reads any weights (the CLI makes them before any other work)."""
    folder = model_folder(name_or_path, hub=hub)
    return folder, read_causal_lm_config(folder, shown=os.fspath(name_or_path))


def load_tokenizer(source: Any, *, default_folder: Path | None = None, hub: bool = True) -> Any:
    """The tokenizer ``source`` names: None the one in ``default_folder`` (None when it has no
    tokenizer files), False none, a path or hub name the one there (a ValueError when it has none),
    a tokenizer object itself."""
    if source is False or (source is None and default_folder is None):
        return None
    if source is not None and not isinstance(source, (str, os.PathLike)):
        if not callable(getattr(source, "batch_decode", None)):
            raise TypeError(f"tokenizer must be a transformers tokenizer, a path or hub name, None (the model "
                            f"folder's own) or False (none), got {type(source).__name__}")
        return source
    if source is None:
        folder, shown = default_folder, str(default_folder)
    else:
        folder, shown = model_folder(source, hub=hub, what="tokenizer", patterns=TOKENIZER_PATTERNS), os.fspath(source)
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        if source is None:
            return None  # a model folder without a tokenizer: token-id prompts only
        raise ValueError(f"tokenizer {shown!r} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)})")
    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as err:
        raise ValueError(f"the tokenizer of {shown!r} does not load: {first_line(err)}") from None


def load_model_and_tokenizer(
    name_or_path: str | os.PathLike,
    *,
    dtype: torch.dtype | str | None = None,
    device: str | torch.device | None = None,
    tokenizer: Any = None,
    hub: bool = True,
) -> tuple[torch.nn.Module, Any]:
    """(model in eval mode on ``device``, tokenizer or None) of a local folder or (``hub``) a hub name.

    ``device``: None is cuda when available, else cpu. ``dtype``: None is ``default_dtype(device)``
    (bfloat16 on CUDA, float32 on CPU), "auto" the checkpoint's own, else a torch dtype or its name.
    ``tokenizer``: None loads the folder's own, and is None when the folder has no tokenizer files
    (token-id prompts only); False loads none; a path or hub name loads that one; a tokenizer object
    is used as is. Safetensors weights only, no code from the checkpoint (``trust_remote_code=False``);
    a local folder is read with no hub access. Every check is made before the weights are read."""
    resolved_device = resolve_device(device)
    resolved_dtype = resolve_dtype(dtype, resolved_device)
    shown = os.fspath(name_or_path) if isinstance(name_or_path, (str, os.PathLike)) else name_or_path
    folder, config = check_model(name_or_path, hub=hub)
    found = load_tokenizer(tokenizer, default_folder=folder, hub=hub)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            folder, config=config, dtype=resolved_dtype, attn_implementation="sdpa", local_files_only=True,
            use_safetensors=True, trust_remote_code=False)
    except (OSError, ValueError) as err:
        raise ValueError(f"the weights of {shown!r} do not load: {first_line(err)}") from None
    # the name a cost file is checked against (engine.model_info.model_name_of): the hub name, not
    # the cache's snapshot folder
    model.config.name_or_path = shown
    return model.to(resolved_device).eval(), found


def first_line(err: BaseException) -> str:
    """The first line of an error from transformers or the hub (theirs run to many lines)."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
