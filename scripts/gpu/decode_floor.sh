#!/usr/bin/env bash
# The GPU runs of issue 57's bf16 targets (decode at the card's floor), any H100/H200 (the record names the card):
#   small    bench decode-step on Qwen2.5-0.5B at 1, 4 and 16 rows (target <= 0.6 ms a step on the H100,
#            <= 0.5 on the H200), the compiled step against the eager one
#   step3b   bench decode-step on Qwen2.5-3B at 32 rows (target <= 2.5 ms on the H100)
#   trace    a paged rollout of 8 rows on Qwen2.5-0.5B kernel by kernel (trace_step.py): what a
#            small-batch step launches and where its time goes
#   nano     bench rl on nano-vllm's shape, the default path (target >= 85% of the card's floor:
#            rollout-lab roofline on its record)
#   tail     bench long-tail, the EOS long tail at 128 slots (target >= 35k tok/s on the H100)
#   OUT=/tmp/o TINY=1 bash scripts/gpu/decode_floor.sh small trace      # CPU, under a minute
#   PACK_TO=$OUT OUT=/tmp/o ROLLOUT_LAB_GIT_SHA=<sha> DEADLINE=570 bash scripts/gpu/decode_floor.sh small step3b trace
source "$(dirname "$0")/common.sh"  # set -u, OUT, PYTHONPATH, PY, step, versions, pack
if [ -n "${TINY:-}" ]; then
  SMALL="--tiny qwen2 --cases 1x24 4x24 16x24 --steps 4"
  STEP3B="--tiny qwen2 --cases 32x24 --steps 4"
  TRACE="--tiny qwen2 --workload nano --num-prompts 8 --max-new-tokens 16 --mode paged"
  NANO="--tiny qwen3 --num-seqs 16 --min-len 8 --max-len 48"
  TAIL="--tiny qwen2 --dataset gsm8k --num-prompts 16 --max-new-tokens 64 --slots 4"
else
  SMALL="--preset qwen2.5-0.5b --cases 1x256 4x256 16x256"
  STEP3B="--preset qwen2.5-3b --cases 32x512"
  TRACE="--preset qwen2.5-0.5b --workload nano --num-prompts 8 --mode paged"
  NANO="--preset qwen3-0.6b"
  TAIL="--preset qwen2.5-0.5b"
fi
BENCH="$PY -m rollout_lab.cli bench"
versions
for what in "$@"; do
  case $what in
    small) step 240 $BENCH decode-step $SMALL --variants ours ours_no_compile --out "$OUT"/decode_step_05b_small ;;
    step3b) step 300 $BENCH decode-step $STEP3B --variants ours --out "$OUT"/decode_step_3b_32 ;;
    trace) step 200 $PY scripts/gpu/trace_step.py $TRACE --top 40 --out "$OUT"/trace_small_batch.txt ;;
    nano) step 300 $BENCH rl $NANO --paths ours --out "$OUT"/rl_nano_default ;;
    tail) step 300 $BENCH long-tail $TAIL --paths paged_128 --out "$OUT"/long_tail_128 ;;
    *) echo "unknown step $what (small, step3b, trace, nano, tail)"; exit 2 ;;
  esac
done
