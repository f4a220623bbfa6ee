#!/usr/bin/env bash
# The GPU runs of issue 55 (rows that outlive a call), any H100/H200 (the record names the card):
#   tool_episodes     256 episodes of up to 4 turns on Qwen2.5-0.5B, answers of 20-200 tokens, against a
#                     single-turn call of the same tokens, at 0 and 50 ms of environment latency
#   partial_rollouts  the EOS long tail (512 rows, 128 slots, Qwen2.5-0.5B): finish_fraction=0.9 against
#                     the full call, and 4 consecutive calls carrying their unfinished rows
#   tests             the CUDA tests of episodes and partial rollouts
#   OUT=/tmp/o TINY=1 bash scripts/gpu/rows_outlive.sh tool_episodes partial_rollouts   # CPU, < 1 min
#   OUT=$OUT ROLLOUT_LAB_GIT_SHA=<sha> DEADLINE=570 bash scripts/gpu/rows_outlive.sh tool_episodes partial_rollouts
# Each bench writes its record after every run, so a step its limit cuts keeps what it finished.
# TE_ARGS and PR_ARGS add options to the tool_episodes and partial_rollouts steps.
source "$(dirname "$0")/common.sh"  # set -u, OUT, PYTHONPATH, PY, step, versions
if [ -n "${TINY:-}" ]; then
  TOOLS="--tiny qwen2 --num-prompts 8 --max-new-tokens 32 --min-len 8 --max-len 32 --answer-min 4 --answer-max 12"
  PARTIAL="--tiny qwen2 --dataset gsm8k --num-prompts 16 --slots 4 --max-new-tokens 48 --hazard 0.05"
else
  TOOLS="--preset qwen2.5-0.5b"; PARTIAL="--preset qwen2.5-0.5b"
fi
versions
for what in "$@"; do
  case $what in
    tool_episodes) step 400 $PY -m rollout_lab.cli bench tool-episodes $TOOLS ${TE_ARGS:-} \
                     --out "$OUT"/tool_episodes ;;
    partial_rollouts) step 400 $PY -m rollout_lab.cli bench partial-rollouts $PARTIAL ${PR_ARGS:-} \
                     --out "$OUT"/partial_rollouts ;;
    tests) step 300 $PY -m pytest -q -x tests/test_episodes.py tests/test_partial_rollouts.py \
                     tests/test_tool_episodes.py ;;
    *) echo "unknown step $what (tool_episodes, partial_rollouts, tests)"; exit 2 ;;
  esac
done
