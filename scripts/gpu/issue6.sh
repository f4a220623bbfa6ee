#!/usr/bin/env bash
# The H200 run behind the README's GPU tables (issues 6 and 7). Writes everything under $OUT.
#   OUT=/tmp/o TINY=1 bash scripts/gpu/issue6.sh     # the same steps on the tiny CPU model
# Each step has its own time limit so that a slow step cannot cost the results of the others;
# sweeps write their record after every workload. Unpack with tar -xzf results.tar.gz.
set -u
OUT=${OUT:?set OUT}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PY=${PY:-python3}
step() { local limit=$1; shift; echo "== $* ($(date +%T))"; timeout "$limit" "$@" 2>&1 | tail -n 25; echo "== rc ${PIPESTATUS[0]}"; }
{
  if [ -n "${TINY:-}" ]; then
    M3="--tiny qwen2"; EXTRA="--scale 0.1 --repetitions 1"; GT="--tiny qwen2 --scale 0.1 --reps 1"
    COSTS=$OUT/cal_tiny.json
    step 120 $PY -m rollout_lab.cli calibrate $M3 --no-progress --out $COSTS
  else
    M3="--preset qwen2.5-3b --dtype bfloat16"; EXTRA="--repetitions 3"; GT="--reps 1"
    COSTS=data/calibration/qwen2.5-3b_bfloat16_cuda.json
  fi
  $PY -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.is_available() and torch.cuda.get_device_name())"
  step 25 $PY -m pytest -q -x tests/test_steppers.py tests/test_attention.py
  # one process per workload: twice a sweep crashed in the workload after HF's compiled peer
  # (torch.compile's CUDA-graph trees) had run in the same process, before our next capture
  for W in long_tail moderate_tail short_similar spread short_tail gsm8k_32; do
    step 60 $PY -m rollout_lab.cli sweep $M3 $EXTRA --no-progress --costs $COSTS --max-new-tokens 16 \
        --workloads $W --paths nocb equal_width aligned bucketed auto hf_static --out $OUT/sweep_3b_16_$W
  done
  $PY scripts/results_table.py $OUT/sweep_3b_16_*.json
  [ -z "${GRPO:-}" ] || { step 60 $PY scripts/bench_grpo.py $GT --out $OUT/grpo_3b \
      && step 30 $PY scripts/plot_grpo.py $OUT/grpo_3b.json --out $OUT; }
} > $OUT/log.txt 2>&1
# the device tool brings back at most 8 files: everything but the log goes into one archive
(cd $OUT && find . -maxdepth 1 -type f ! -name log.txt ! -name results.tar.gz -printf '%P\n' \
    | tar -czf results.tar.gz -T - --remove-files)
tail -c 11000 $OUT/log.txt
