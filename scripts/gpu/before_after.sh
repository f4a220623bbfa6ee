#!/usr/bin/env bash
# An engine change against the commit before it, on one machine: the same benches on the tree in
# before/ (an archive of that commit's rollout_lab/, untracked so that it travels, never committed)
# and on this tree, one after the other, each in its own process; then the GPU-only tests.
#   git archive <sha> rollout_lab | tar -x -C before/       # the tree to compare with
#   OUT=/tmp/o TINY=1 bash scripts/gpu/before_after.sh long_tail nano   # the same steps on a tiny CPU model
#   OUT=$OUT ROLLOUT_LAB_GIT_SHA=<sha> BEFORE_SHA=<sha> DEADLINE=570 bash scripts/gpu/before_after.sh tests long_tail
# Records: $OUT/long_tail_{before,after}*, $OUT/rl_nano_{before,after}*, each with its own provenance
# (ROLLOUT_LAB_GIT_SHA for this tree, BEFORE_SHA for before/).
source "$(dirname "$0")/common.sh"  # set -u, OUT, PYTHONPATH, PY, step, versions
[ -d before/rollout_lab ] || { echo "no before/rollout_lab: git archive <sha> rollout_lab | tar -x -C before/"; exit 2; }
if [ -n "${TINY:-}" ]; then
  LONG="--tiny qwen2 --dataset gsm8k --num-prompts 16 --max-new-tokens 64 --hazard 0.05 --slots 4 --reps 1"
  NANO="--tiny qwen2 --num-seqs 16 --min-len 8 --max-len 48 --reps 1"
else
  LONG="--preset qwen2.5-0.5b --dtype bfloat16 --reps 3"
  NANO="--preset qwen3-0.6b --dtype bfloat16"
fi
AFTER_SHA=${ROLLOUT_LAB_GIT_SHA:-unknown}
# tree WHICH: the environment that runs a command on before/ or on this tree, its records named after
# that tree's commit (timeout runs programs, not shell functions: env does it)
tree() { if [ "$1" = before ]; then echo "PYTHONPATH=$PWD/before ROLLOUT_LAB_GIT_SHA=${BEFORE_SHA:-unknown}"
         else echo "PYTHONPATH=$PWD ROLLOUT_LAB_GIT_SHA=$AFTER_SHA"; fi; }
versions
for what in "$@"; do
  case $what in
    tests) step 300 $PY -m pytest -q -p no:cacheprovider -x tests/test_steppers.py tests/test_logprobs.py \
             tests/test_span_attention.py tests/test_paged_attention.py tests/test_trainer.py tests/test_shape_classes.py ;;
    long_tail) for which in before after; do
                 step 240 env $(tree $which) $PY -m rollout_lab.cli bench long-tail $LONG --paths paged_128 \
                   --out "$OUT"/long_tail_$which
               done ;;
    nano) for which in before after; do
            step 240 env $(tree $which) $PY -m rollout_lab.cli bench rl $NANO --mode paged --paths ours --out "$OUT"/rl_nano_$which
          done ;;
    *) echo "unknown step $what (tests, long_tail, nano)"; exit 2 ;;
  esac
done
