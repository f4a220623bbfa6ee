#!/usr/bin/env bash
# The GPU runs of issue 56 (batch-invariant forwards), any H100/H200 (the record names the card):
#   tests      the CUDA tests of the invariant kernels and of whole invariant rollouts (bits)
#   loop_05b   bench trainer-loop on Qwen2.5-0.5B (64 x 8 x 256): batch_invariant, then the default mode
#              (compiled: its first call pays the compile) and logprobs_mode="trainer" (the recompute)
#              on the same card: notebook 03's logprob_modes_results_file takes the three records
#   loop_3b    the same on Qwen2.5-3B
#   trace      the invariant rollout of loop_05b's shape, kernel by kernel (trace_step.py --batch-invariant),
#              and the default one beside it: where the invariant step's time goes
#   OUT=/tmp/o TINY=1 bash scripts/gpu/batch_invariant.sh loop_05b   # CPU under TRITON_INTERPRET=1, ~2 min
#   OUT=$OUT ROLLOUT_LAB_GIT_SHA=<sha> DEADLINE=570 bash scripts/gpu/batch_invariant.sh tests loop_05b
# Each bench writes its record after every iteration, so a step its limit cuts keeps what it finished.
# BI_ARGS adds options to every trainer-loop step.
source "$(dirname "$0")/common.sh"  # set -u, OUT, PYTHONPATH, PY, step, versions
if [ -n "${TINY:-}" ]; then
  export TRITON_INTERPRET=1
  SMALL="--tiny qwen2 --num-prompts 4 --num-samples 2 --max-new-tokens 8 --scale 0.1 --iterations 1"
  LOOP_05B="$SMALL"; LOOP_3B="$SMALL"
  TRACE="--tiny qwen2 --workload grpo --num-prompts 2 --max-new-tokens 4"
else
  TRACE="--preset qwen2.5-0.5b --workload grpo --num-prompts 64"
  LOOP_05B="--preset qwen2.5-0.5b --train-rows 64 --iterations 2"
  LOOP_3B="--preset qwen2.5-3b --train-rows 16 --iterations 2"
fi
LOOP="$PY -m rollout_lab.cli bench trainer-loop --mode auto"
versions
for what in "$@"; do
  case $what in
    tests) step 300 $PY -m pytest -q -x tests/test_invariant_kernels.py tests/test_batch_invariant.py -k cuda ;;
    loop_05b) step 300 $LOOP $LOOP_05B --batch-invariant ${BI_ARGS:-} --out "$OUT"/trainer_loop_05b_invariant
              step 400 $LOOP $LOOP_05B ${BI_ARGS:-} --out "$OUT"/trainer_loop_05b_default
              step 300 $LOOP $LOOP_05B --logprobs-mode trainer ${BI_ARGS:-} --out "$OUT"/trainer_loop_05b_trainer ;;
    loop_3b) step 400 $LOOP $LOOP_3B --batch-invariant ${BI_ARGS:-} --out "$OUT"/trainer_loop_3b_invariant
             step 400 $LOOP $LOOP_3B ${BI_ARGS:-} --out "$OUT"/trainer_loop_3b_default ;;
    trace) step 240 $PY scripts/gpu/trace_step.py $TRACE --batch-invariant --top 40 --out "$OUT"/trace_invariant.txt
           step 200 $PY scripts/gpu/trace_step.py $TRACE --top 40 --out "$OUT"/trace_default.txt ;;
    *) echo "unknown step $what (tests, loop_05b, loop_3b, trace)"; exit 2 ;;
  esac
done
