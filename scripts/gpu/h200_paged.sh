#!/usr/bin/env bash
# The H200 runs of the paged route (issue 32): its bf16 decode step by teacher-forced logits, the EOS
# long-tail workload (Qwen2.5-0.5B, 512 GPQA-length prompts, 2,048 new tokens, sampled at T=1 and
# ended by EOS: the paged and aligned caches at 128 slots and with every row / the memory budget's
# slots), and nano-vllm's shape (Qwen3-0.6B, 256 requests, U(100, 1024) prompts and budgets) on the
# paged and bucketed routes.
#   OUT=/tmp/o TINY=1 bash scripts/gpu/h200_paged.sh logits long_tail nano   # the same steps on a tiny CPU model
#   OUT=$OUT ROLLOUT_LAB_GIT_SHA=<sha> DEADLINE=570 bash scripts/gpu/h200_paged.sh logits long_tail   # one device call
#   ... bash scripts/gpu/h200_paged.sh nano                                                       # the next
#   ... bash scripts/gpu/h200_paged.sh kernel   # the kernel's GB/s per (warps, stages): scripts/gpu/paged_kernel.py
#   ... bash scripts/gpu/h200_paged.sh trace    # kernel-by-kernel profiles of nano's shape and the long tail at 128 slots
# Every bench writes its record after each path, so a step its limit cuts loses nothing it finished.
# LONG_TAIL_PATHS / NANO_MODES / NANO_PATHS pick the long-tail paths, the nano-vllm routes and their
# variants: LONG_TAIL_PATHS="paged_128 paged_128_unfused" NANO_PATHS="ours ours_unfused" time the fused
# projections (engine.runner.fusing, on by default) against the unfused step side by side, and
# LONG_TAIL_PATHS="paged_128 paged_128_compile_model" NANO_PATHS="ours ours_compile_model" the whole model's
# compile against the layer-wise default (engine.runner.compiling: one trace for every layer), first call and step;
# TRACE_ARGS adds options to trace_step.py (--no-fuse-projections).
source "$(dirname "$0")/common.sh"  # set -u, OUT, PYTHONPATH, PY, step, versions
if [ -n "${TINY:-}" ]; then
  LOGITS="--tiny qwen3 --num-seqs 4 --min-len 4 --max-len 40 --steps 8"
  LONG="--tiny qwen2 --dataset gsm8k --num-prompts 16 --max-new-tokens 128 --hazard 0.05 --slots 4"
  NANO="--tiny qwen2 --num-seqs 16 --min-len 8 --max-len 48"
  TRACE_NANO="--tiny qwen3 --num-prompts 16 --max-new-tokens 120"
  TRACE_LONG="--tiny qwen2 --dataset gsm8k --num-prompts 16 --max-new-tokens 64 --slots 4"
else
  LOGITS="--preset qwen3-0.6b --dtype bfloat16 --steps 32"
  LONG="--preset qwen2.5-0.5b --dtype bfloat16"
  NANO="--preset qwen3-0.6b --dtype bfloat16"
  TRACE_NANO="--preset qwen3-0.6b"
  TRACE_LONG="--preset qwen2.5-0.5b --num-prompts 512 --max-new-tokens 2048"
fi
LONG_TAIL_PATHS=${LONG_TAIL_PATHS:-paged_128 paged_128_eos_every_step aligned_128 paged_memory aligned_all}
NANO_MODES=${NANO_MODES:-paged bucketed}
versions
for what in "$@"; do
  case $what in
    logits) step 240 $PY -m rollout_lab.cli bench logits $LOGITS --cache paged --variants ours ours_no_compile \
                --out "$OUT"/fidelity_paged ;;
    long_tail) step 540 $PY -m rollout_lab.cli bench long-tail $LONG --paths $LONG_TAIL_PATHS --out "$OUT"/long_tail ;;
    nano) for mode in $NANO_MODES; do
            step 300 $PY -m rollout_lab.cli bench rl $NANO --mode "$mode" --paths ${NANO_PATHS:-ours} --out "$OUT"/rl_nano_"$mode"
          done ;;
    # the decode-attention kernel alone: its bandwidth under each launch setting (a diagnostic, no record)
    kernel) if [ -n "${TINY:-}" ]; then export TRITON_INTERPRET=1; fi
            step 240 $PY scripts/gpu/paged_kernel.py ${TINY:+--tiny} --out "$OUT"/paged_kernel.txt ;;
    # torch.profiler over one warm call (diagnostics, no record): which kernels the step's time goes to
    trace) step 240 $PY scripts/gpu/trace_step.py $TRACE_NANO ${TRACE_ARGS:-} --workload nano --out "$OUT"/trace_nano.txt
           step 300 $PY scripts/gpu/trace_step.py $TRACE_LONG ${TRACE_ARGS:-} --workload eos_long_tail \
                --out "$OUT"/trace_long_tail.txt ;;
    *) echo "unknown step $what (logits, long_tail, nano, kernel, trace)"; exit 2 ;;
  esac
done
