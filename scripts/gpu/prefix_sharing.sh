#!/usr/bin/env bash
# The GPU runs of issue 54 (shared prompt blocks on the paged route): `bench prefix-sharing` times
# today's copies (share_prompt_blocks=False) against shared blocks, and the shared read off against on
# (shared_prefix_attention), on the issue's shapes, any H100/H200 (the record names the card):
#   long_prompt     grpo_long_prompt: 32 prompts of 1,500-2,500 tokens x 16 x 512 on Qwen2.5-3B, T=1: copies,
#                   shared blocks read per row, and shared as the engine picks its read (auto)
#   many_samples    many_samples_short: 128 GSM8K prompts x 32 x 256 on Llama-3.2-1B's geometry
#   prefix_lengths  grpo_long_prompt's shape at prompts of 256, 1,024 and 2,048 tokens (notebook 03's figure)
#   reads           grpo_long_prompt, shared blocks read per row against once per group (shared_prefix_attention)
#   grpo            64 GSM8K prompts x 8 x 512 on Qwen2.5-3B: `bench grpo` as today, then copies against shared
#   OUT=/tmp/o TINY=1 bash scripts/gpu/prefix_sharing.sh long_prompt many_samples prefix_lengths grpo   # CPU, < 1 min
#   OUT=$OUT ROLLOUT_LAB_GIT_SHA=<sha> DEADLINE=570 bash scripts/gpu/prefix_sharing.sh long_prompt   # one device call
#   ... bash scripts/gpu/prefix_sharing.sh many_samples                                             # the next
# The copies' pool of these shapes takes most of the card, so every full-scale step but `reads` runs its
# paths one at a time (--sequential: each alone on the device, its memory released before the next);
# TINY=1 runs them interleaved, as the bench does by default. Each bench writes its record after every
# case or path, so a step its limit cuts keeps what it finished. PS_ARGS adds options to every
# prefix-sharing step (e.g. "--reps 1").
source "$(dirname "$0")/common.sh"  # set -u, OUT, PYTHONPATH, PY, step, versions
if [ -n "${TINY:-}" ]; then
  SMALL="--num-samples 4 --max-new-tokens 16 --reps 1"
  LONG="--tiny qwen2 --scale 0.1 --num-prompts 4 $SMALL"
  MANY="--tiny llama --num-prompts 8 $SMALL"
  LENGTHS="--tiny qwen2 --num-prompts 4 $SMALL --prompt-lengths 64 128 256"
  GRPO="--tiny qwen2 --scale 0.1 --num-prompts 8 --max-new-tokens 16 --reps 1"
  GRPO_SHARING="--tiny qwen2 --num-prompts 8 $SMALL"  # GSM8K lengths unscaled: prompts past one KV block
  ONE_AT_A_TIME=""
else
  LONG="--preset qwen2.5-3b"; MANY="--preset llama-3.2-1b"
  LENGTHS="--preset qwen2.5-3b --prompt-lengths 256 1024 2048 --reps 1"
  GRPO="--preset qwen2.5-3b --max-new-tokens 512 --reps 1"; GRPO_SHARING="--preset qwen2.5-3b"
  ONE_AT_A_TIME="--sequential"
fi
BENCH="$PY -m rollout_lab.cli bench prefix-sharing"
versions
for what in "$@"; do
  case $what in
    long_prompt) step 570 $BENCH --workload grpo_long_prompt $LONG $ONE_AT_A_TIME --paths copies shared_read_off shared \
                     ${PS_ARGS:-} \
                     --out "$OUT"/prefix_sharing_grpo_long_prompt ;;
    many_samples) step 570 $BENCH --workload many_samples_short $MANY $ONE_AT_A_TIME ${PS_ARGS:-} \
                     --out "$OUT"/prefix_sharing_many_samples_short ;;
    prefix_lengths) step 570 $BENCH --workload grpo_long_prompt $LENGTHS $ONE_AT_A_TIME ${PS_ARGS:-} \
                     --out "$OUT"/prefix_sharing_prefix_lengths ;;
    # two shared pools fit the card together: interleaved
    reads) step 570 $BENCH --workload grpo_long_prompt $LONG --paths shared_read_off shared_read_on ${PS_ARGS:-} \
                     --out "$OUT"/prefix_sharing_reads ;;
    grpo) step 450 $PY -m rollout_lab.cli bench grpo $GRPO --out "$OUT"/grpo
          step 450 $BENCH --workload grpo_gsm8k $GRPO_SHARING $ONE_AT_A_TIME ${PS_ARGS:-} \
                     --out "$OUT"/prefix_sharing_grpo_gsm8k ;;
    *) echo "unknown step $what (long_prompt, many_samples, prefix_lengths, reads, grpo)"; exit 2 ;;
  esac
done
