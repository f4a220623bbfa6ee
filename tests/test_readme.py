"""The README's trainer loop runs as written (on a tiny CPU model), and its claim holds: with
logprobs_mode="trainer" the trainer's forward of the rollout's batch equals the rollout's logprobs."""
from __future__ import annotations

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def trainer_loop_code() -> str:
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## In a trainer loop"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_trainer_loop_runs_and_its_logprobs_are_the_trainers():
    code = trainer_loop_code()
    preset = 'from_preset("qwen2.5-0.5b", dtype=torch.bfloat16, device="cuda")'
    assert preset in code and 'device="cuda"' in code and ".cuda()" in code  # what the edits below replace
    code = code.replace(preset, 'tiny_model("qwen2")').replace('device="cuda"', 'device="cpu"').replace(".cuda()", "")
    gen = torch.Generator().manual_seed(0)
    scope = {
        "tiny_model": __import__("rollout_lab.measure.models", fromlist=["tiny_model"]).tiny_model,
        "batches": [[torch.randint(5, 300, (n,), generator=gen).tolist() for n in (3, 9, 5)]],
        "my_rewards": lambda requests: torch.tensor([float(len(o.token_ids) % 3) for r in requests for o in r.outputs]),
    }
    code = code.replace("max_new_tokens=1024", "max_new_tokens=6")
    exec(compile(code, str(README), "exec"), scope)  # noqa: S102 - the README's own example
    batch, new = scope["batch"], scope["new"]
    assert batch["logprobs"].shape == new.shape == batch["response_mask"].shape
    assert torch.equal(new.detach(), batch["logprobs"])  # bit for bit, as the README says
