#!/usr/bin/env bash
# The H200 runs behind issue 15 (prefill near the bound): calibration with packed forwards, then the
# seed's five workloads, GSM8K 32 and GPQA-like 32 / 128 through nocb, bucketed, packed and Auto at
# the shape-class ladder with captured prefill, then HF static + compile in its own process (its
# CUDA-graph trees must not share a process with our captures).
#   OUT=/tmp/o TINY=1 bash scripts/gpu/h200_prefill.sh calibrate sweep prefill peer   # a tiny CPU check
#   OUT=$OUT ROLLOUT_LAB_GIT_SHA=<sha> bash scripts/gpu/h200_prefill.sh tests calibrate   # one device call
#   ... bash scripts/gpu/h200_prefill.sh sweep ; ... prefill ; ... peer                   # the next ones
# Every step has its own time limit; the sweeps write their record after every workload. The
# calibration times prefill by graph replay (the sweep's prefill), and its decode probe pays the
# first compile of the step (~4 min for the 3B): give it a call of its own. Measured 2026-12-03:
# tests 83 s, calibrate (eager prefill) 296 s, sweep 352 s, peer 233 s; with compiled prefill graphs
# (289680a, a cold machine): tests 71 s, calibrate ~470 s, and the sweep ran 7 of its 8 workloads in
# 540 s (its first compile included): give gpqa_diamond_128 a second call with RESUME. The crossing
# bench (2026-12-04): cold, 400 s were not enough for its first batch; with inductor's cache of that
# call carried in, prefill (32 and 128 prompts) took ~200 s, its first bucketed call 103 s; prefill512's
# bucketed warm-up alone took 161 s, so its bimodal batch needs a call of its own (or the cache).
# Issue 33 (defaults): RolloutConfig() with nothing set against the tuned setting (this calibration,
# the class ladder, captured prefill) on the seed's five, GSM8K 32 and GPQA-like 32, one Rollout each;
# defaults_warm runs the same command again in a new process: its first call with the caches warm.
#   ... bash scripts/gpu/h200_prefill.sh defaults defaults_warm
source "$(dirname "$0")/common.sh"  # set -u, OUT, PYTHONPATH, PY, step, versions
# WORKLOADS=... and SWEEP_LIMIT=<s> fit the sweep to what device time is left (the record keeps the finished ones);
# PREFILL_LIMIT=<s> does the same for the crossing bench (its record is written after every batch)
WORKLOADS=${WORKLOADS:-"short_similar long_tail short_tail moderate_tail spread gsm8k_32 gpqa_diamond_32 gpqa_diamond_128"}
if [ -n "${TINY:-}" ]; then
  M="--tiny qwen2"; CAL="--grid tiny"; EXTRA="--scale 0.1 --repetitions 1"; GRAPHS="--prefill-classes"
  PREFILL="--tiny qwen2 --batch-sizes 4 8 --repetitions 1"; PREFILL512="--tiny qwen2 --batch-sizes 16 --repetitions 1 --routes bucketed packed"
  DEF="--tiny qwen2 --scale 0.1 --max-new-tokens 4 --repetitions 1"; TUNED_COSTS=${TUNED_COSTS-}
else
  M="--preset qwen2.5-3b --dtype bfloat16"; CAL="--repeats 3 --prefill-graphs"; EXTRA="--repetitions 3"; GRAPHS="--prefill-graphs"
  PREFILL="--preset qwen2.5-3b --prefill-graphs --batch-sizes 32 128 --repetitions 2"
  PREFILL512="--preset qwen2.5-3b --prefill-graphs --batch-sizes 512 --repetitions 2 --routes bucketed packed"
  DEF="--preset qwen2.5-3b --repetitions 3"
  # the tuned side's calibration: the H200's; TUNED_COSTS= (empty) on another GPU, where that file is refused,
  # prices it by the reference's coefficients (its first calls and the default's still measure issue 33's times)
  TUNED_COSTS=${TUNED_COSTS-data/calibration/qwen2.5-3b_bfloat16_cuda_prefill-graphs.json}
fi
# RESUME=<dir> holding sweep_ours.json/.csv from an earlier call: the sweep keeps its workloads
# (rollout-lab sweep --resume) and runs the rest, so a sweep longer than one call spans two.
COSTS=${COSTS:-$OUT/calibration.json}  # calibrate writes it; the other steps read it (COSTS=<file> from an earlier call)
versions
for what in "$@"; do
  case $what in
    tests) step 300 $PY -m pytest -q -x tests/test_shape_classes.py tests/test_packing.py tests/test_span_attention.py ;;
    calibrate) step 480 $PY -m rollout_lab.cli calibrate $M $CAL --no-progress --out $COSTS ;;
    sweep) if [ -n "${RESUME:-}" ]; then cp "$RESUME"/sweep_ours.json "$RESUME"/sweep_ours.csv "$OUT"/ || exit 1; fi
           step ${SWEEP_LIMIT:-540} $PY -m rollout_lab.cli sweep $M $EXTRA $GRAPHS --no-progress --costs $COSTS --max-new-tokens 16 \
               --workloads $WORKLOADS --paths nocb bucketed packed auto ${RESUME:+--resume} --out $OUT/sweep_ours ;;
    prefill) step ${PREFILL_LIMIT:-400} $PY -m rollout_lab.cli bench prefill-routes $PREFILL --costs $COSTS --out $OUT/prefill_routes ;;
    # 512 prompts without nocb: its padded forward of 512 x ~2048 tokens ran out of the H200's memory
    prefill512) step ${PREFILL_LIMIT:-300} $PY -m rollout_lab.cli bench prefill-routes $PREFILL512 --costs $COSTS --out $OUT/prefill_routes_512 ;;
    peer)  step 540 $PY -m rollout_lab.cli sweep $M $EXTRA --no-progress --max-new-tokens 16 \
               --workloads $WORKLOADS --paths hf_static --out $OUT/sweep_hf_static ;;
    defaults) step ${DEFAULTS_LIMIT:-380} $PY -m rollout_lab.cli bench defaults $DEF ${TUNED_COSTS:+--tuned-costs $TUNED_COSTS} \
                --out $OUT/defaults ;;
    # the same command in a new process: the compiled artifacts and learned costs the first one cached
    defaults_warm) step 540 $PY -m rollout_lab.cli bench defaults $DEF ${TUNED_COSTS:+--tuned-costs $TUNED_COSTS} \
                --out $OUT/defaults_warm ;;
    *) echo "unknown step $what (tests, calibrate, sweep, prefill, prefill512, peer, defaults, defaults_warm)"; exit 2 ;;
  esac
done
