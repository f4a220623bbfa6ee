#!/usr/bin/env bash
# The GPU runs of issue 57's FP8 KV cache (RolloutConfig(kv_cache_dtype="fp8")), any H100/H200 (the record names the card):
#   tests    the CUDA tests of the FP8 write kernel and of the paged kernel over FP8 pools
#   logits   bench logits on nano-vllm's model, paged: the bf16 pool against the FP8 one (logit and logprob errors)
#   nano     bench rl on nano-vllm's shape: ours (bucketed), ours_paged and ours_fp8_kv side by side
#   tail     bench long-tail (the EOS long tail, 512 rows on 128 slots): paged_128 against paged_128_fp8_kv
#   trace    the nano shape's paged step kernel by kernel, bf16 pool then FP8 (trace_step.py --kv-cache-dtype)
#   OUT=/tmp/o TINY=1 bash scripts/gpu/fp8_kv.sh logits nano     # CPU, ~1 min
#   OUT=$OUT ROLLOUT_LAB_GIT_SHA=<sha> DEADLINE=570 bash scripts/gpu/fp8_kv.sh tests logits nano
# NANO_PATHS replaces the nano step's paths (in order: put the one a short DEADLINE must not cut first).
source "$(dirname "$0")/common.sh"  # set -u, OUT, PYTHONPATH, PY, step, versions
if [ -n "${TINY:-}" ]; then
  LOGITS="--tiny qwen3 --num-seqs 4 --min-len 4 --max-len 20 --steps 6"
  NANO="--tiny qwen3 --num-seqs 16 --min-len 8 --max-len 48"
  TRACE="--tiny qwen3 --workload nano --num-prompts 8 --max-new-tokens 24 --mode paged"
  TAIL="--tiny qwen2 --dataset gsm8k --num-prompts 16 --max-new-tokens 64 --slots 4"
else
  TAIL="--preset qwen2.5-0.5b"
  TRACE="--preset qwen3-0.6b --workload nano --mode paged"
  LOGITS="--preset qwen3-0.6b --num-seqs 16 --steps 64"
  NANO="--preset qwen3-0.6b"
fi
BENCH="$PY -m rollout_lab.cli bench"
versions
for what in "$@"; do
  case $what in
    tests) step 240 $PY -m pytest -q -x tests/test_kv_fp8.py tests/test_paged_attention.py -k cuda ;;
    logits) step 240 $BENCH logits $LOGITS --variants ours_paged ours_fp8_kv --out "$OUT"/logits_fp8_kv ;;
    nano) step 420 $BENCH rl $NANO --paths ${NANO_PATHS:-ours ours_paged ours_fp8_kv} --out "$OUT"/rl_nano_fp8_kv ;;
    tail) step 420 $BENCH long-tail $TAIL --paths paged_128 paged_128_fp8_kv --out "$OUT"/long_tail_fp8_kv ;;
    trace) step 200 $PY scripts/gpu/trace_step.py $TRACE --out "$OUT"/trace_nano_paged.txt
           step 200 $PY scripts/gpu/trace_step.py $TRACE --kv-cache-dtype fp8 --out "$OUT"/trace_nano_fp8.txt ;;
    *) echo "unknown step $what (tests, logits, nano, tail, trace)"; exit 2 ;;
  esac
done
