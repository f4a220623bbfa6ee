#!/usr/bin/env bash
# The H200 runs behind issue 18 that are not notebooks (those are scripts/gpu/h200_notebooks.sh): Qwen3-32B
# in bf16 (the reference's own validation model, ~65 GB) on the seed's five workloads at 16 new tokens,
# our four routes with captured prefill graphs, then HF static + compile in its own process.
#   OUT=/tmp/o TINY=1 bash scripts/gpu/h200_qwen3_32b.sh qwen3_32b_calibrate qwen3_32b qwen3_32b_peer  # tiny CPU check
#   OUT=$OUT ROLLOUT_LAB_GIT_SHA=<sha> bash scripts/gpu/h200_qwen3_32b.sh qwen3_32b     # one device call
#   ... bash scripts/gpu/h200_qwen3_32b.sh qwen3_32b_peer                              # the next
# Our graphs capture the eager model (--no-compile): a compile of the 64-layer model would take
# minutes of the call, and at 32B the decode step is bound by streaming 65 GB of weights (~15 ms)
# more than by its small kernels. Auto is priced by the 32B calibration of qwen3_32b_calibrate (or
# COSTS), else by the reference's coefficients (see below). The sweep writes its record after each
# workload; RESUME=<dir> holding sweep_32b.json/.csv continues one that a call's limit cut.
# No oracle check (--oracle-max-tokens 0): bf16 token matches on random weights mean nothing, and 32
# one-request generates of the 64-layer model per workload would take a good part of the call. With
# DEADLINE=<s> both steps run in one call: ours first (at most 300 s), the peer in what is left.
# Measured 2026-12-04 (git e04b323, a warm machine, DEADLINE=575): qwen3_32b 162 s with the model
# build, qwen3_32b_peer ~215 s (its first compile 68-98 s per workload shape).
source "$(dirname "$0")/common.sh"  # set -u, OUT, PYTHONPATH, PY, step, versions
WORKLOADS="short_similar long_tail short_tail moderate_tail spread"
if [ -n "${TINY:-}" ]; then
  M="--tiny qwen3"; EXTRA="--scale 0.1 --repetitions 1"; GRAPHS="--prefill-classes"; CAL="--grid tiny --repeats 1"
else
  M="--preset qwen3-32b --dtype bfloat16"; EXTRA="--repetitions 3"; GRAPHS="--prefill-graphs"
  CAL="--repeats 2 --max-batch-tokens 8192 --prefill-graphs --no-compile"
fi
# Without a 32B calibration Auto is priced by the reference's coefficients, and at e04b323 it took nocb
# on two short workloads (1.99x and 2.25x the best route). qwen3_32b_calibrate writes $OUT/calibration_32b.json
# (the eager model captured, as the sweep runs it); qwen3_32b prices Auto with it, or with COSTS=<file>.
# At 85f4a31 the calibration took 135 s (39 shapes), and a sweep of bucketed, packed and auto priced by
# it 97 s (run by hand, without nocb, to fit the device time left): Auto/best 1.000-1.011 on four of five.
COSTS=${COSTS:-$OUT/calibration_32b.json}
versions
for what in "$@"; do
  case $what in
    qwen3_32b_calibrate) step 360 $PY -m rollout_lab.cli calibrate $M $CAL --no-progress --out "$COSTS" ;;
    qwen3_32b) if [ -n "${RESUME:-}" ]; then cp "$RESUME"/sweep_32b.json "$RESUME"/sweep_32b.csv "$OUT"/ || exit 1; fi
               step 300 $PY -m rollout_lab.cli sweep $M $EXTRA $GRAPHS --no-compile --no-progress --max-new-tokens 16 --oracle-max-tokens 0 \
                   --workloads $WORKLOADS --paths nocb bucketed packed auto ${RESUME:+--resume} --out $OUT/sweep_32b \
                   $([ -f "$COSTS" ] && echo "--costs $COSTS") ;;
    qwen3_32b_peer) step 560 $PY -m rollout_lab.cli sweep $M $EXTRA --no-progress --max-new-tokens 16 --oracle-max-tokens 0 \
                   --workloads $WORKLOADS --paths hf_static --out $OUT/sweep_32b_hf_static ;;
    *) echo "unknown step $what (qwen3_32b_calibrate, qwen3_32b, qwen3_32b_peer)"; exit 2 ;;
  esac
done
