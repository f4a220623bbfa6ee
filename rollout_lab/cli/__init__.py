"""The ``rollout-lab`` command: plan, calibrate, sweep, notebooks, reproduce, bench.

    rollout-lab plan 512 16 16 16 --max-new-tokens 16
    rollout-lab plan --dataset gsm8k --num-prompts 32          # a real GSM8K batch (shipped lengths)
    rollout-lab plan --file lengths.csv --preset qwen3-0.6b     # numbers, or a CSV with a header
    rollout-lab calibrate --tiny qwen2                          # -> <out-dir>/data/calibration/
    rollout-lab sweep --tiny qwen2 --workloads long_tail spread # -> <out-dir>/data/results/
    rollout-lab notebooks --only 02                             # -> <out-dir>/figures, data/tables
    rollout-lab reproduce                                       # what `make reproduce` runs
    rollout-lab bench rl --tiny qwen2 --num-seqs 16 --min-len 8 --max-len 48 --out /tmp/rl  # -> /tmp/rl.json, .csv
    rollout-lab bench {rl,grpo,decode-step,prefill-routes,logits,long-tail,trainer-loop,defaults} --help

(``python -m rollout_lab.cli ...`` is the same command.) Outputs go to the workspace: ``--out-dir``,
else ``$ROLLOUT_LAB_OUT``, else ``./rollout_lab_out`` (``rollout_lab.workspace``); a ``bench`` writes
its record where ``--out`` says (never over one).

``main`` holds the parser, ``main()`` and the commands that are not a bench; ``bench`` the benches;
``model`` the options of the model a command runs and building it; ``options`` the argparse pieces
they all share. ``plan`` needs no torch; the commands that run a model import it when they start.
"""
