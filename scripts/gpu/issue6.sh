#!/usr/bin/env bash
# The H200 run behind the README's GPU tables (issues 4, 6, 7). Writes everything under $OUT.
#   OUT=/tmp/o TINY=1 bash scripts/gpu/issue6.sh     # the same steps on the tiny CPU model, seconds
# Each step has its own time limit so that a slow step cannot cost the results of the others.
set -u
OUT=${OUT:?set OUT}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PY=${PY:-python3}
if [ -n "${TINY:-}" ]; then
  M3="--tiny qwen2"; M32="--tiny qwen3"; EXTRA="--scale 0.1"; T=60; GT="--tiny qwen2 --scale 0.1"
else
  M3="--preset qwen2.5-3b --dtype bfloat16"; M32="--preset qwen3-32b --dtype bfloat16"; EXTRA=""; T=1; GT=""
fi
step() { local limit=$1; shift; echo "== $* ($(date +%T))"; timeout "$limit" "$@" 2>&1 | tail -n 25; echo "== rc ${PIPESTATUS[0]}"; }
{
  $PY -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.is_available() and torch.cuda.get_device_name())"
  step 45 $PY -m pytest -q -x tests/test_graph.py tests/test_attention.py
  step 60 $PY -m rollout_lab.cli calibrate $M3 --repeats 2 --no-progress --out $OUT/cal_3b.json
  step 160 $PY -m rollout_lab.cli sweep $M3 $EXTRA --no-progress --costs $OUT/cal_3b.json --max-new-tokens 16 \
      --repetitions 3 --workloads long_tail moderate_tail short_similar spread short_tail gsm8k_32 \
      --paths nocb equal_width aligned bucketed auto hf_static --out $OUT/sweep_3b_16
  step 90 $PY -m rollout_lab.cli sweep $M3 $EXTRA --no-progress --costs $OUT/cal_3b.json --max-new-tokens 128 \
      --repetitions 2 --workloads long_tail moderate_tail gsm8k_32 \
      --paths nocb equal_width aligned bucketed auto hf_static --out $OUT/sweep_3b_128
  step 90 $PY scripts/bench_grpo.py $GT --reps 2 --out $OUT/grpo_3b
} > $OUT/log.txt 2>&1
cat $OUT/log.txt | tail -c 11000
