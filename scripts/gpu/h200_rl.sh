#!/usr/bin/env bash
# The H200 runs behind issue 14's records: the decode step (Qwen2.5-3B) and the RL-shape throughput
# (Qwen3-0.6B), with span attention and the compiled step against their ablations; the bf16
# teacher-forced logits check, GRPO 64 x 8 x 512 and 128 GPQA-like prompts x 256 tokens at 128 slots
# (Qwen2.5-3B; `gpqa` runs our routes at the prefill-graph ladder, `gpqa_peer` HF static + compile in
# its own process; COSTS=<calibration> prices Auto). A cold 3B decode compile plus the prefill graphs
# ran past 300 s for `gpqa`: it gets 540 s (GPQA_LIMIT) and wants INDUCTOR_CACHE carried in.
#   OUT=/tmp/o TINY=1 bash scripts/gpu/h200_rl.sh tests step rl    # the same steps on a tiny CPU model
#   OUT=$OUT ROLLOUT_LAB_GIT_SHA=<sha> bash scripts/gpu/h200_rl.sh tests step   # one device call
#   ... bash scripts/gpu/h200_rl.sh rl                                           # the next
# Each step has its own time limit, sized from measured times (the device tool allows 600 s a call),
# and every bench writes its record after each case or path, so a step that runs out loses nothing
# it finished. RL_PATHS picks `bench rl`'s paths (e.g. "ours hf_generate_batch" for the peer).
# trainer_loop*: Rollout.generate alternated with a GRPO step on one Qwen2.5-0.5B (64 x 8 x 256, T=1):
# the decode step's logprobs, then logprobs_mode=trainer, then parameters replaced by
# load_state_dict(assign=True) after each step (with gradient checkpointing: _assign_checkpointing), and
# trainer_loop_3b the same loop on Qwen2.5-3B; TL_ARGS adds options (e.g. --train-mode train).
source "$(dirname "$0")/common.sh"  # set -u, OUT, PYTHONPATH, PY, step, versions
if [ -n "${TINY:-}" ]; then
  STEP="--tiny qwen2 --cases 4x40 6x60 --steps 8"; RL="--tiny qwen2 --num-seqs 16 --min-len 8 --max-len 48"
  LOGITS="--tiny qwen3 --num-seqs 4 --min-len 4 --max-len 20 --steps 6"; GRPO="--tiny qwen2 --scale 0.1 --max-new-tokens 16"
  GPQA="--tiny qwen2 --scale 0.1 --repetitions 1 --max-new-tokens 8 --prefill-classes"; PEER="--tiny qwen2 --scale 0.1 --repetitions 1 --max-new-tokens 8"
  VARIANTS="ours ours_no_compile ours_masked"
  TL="--tiny qwen2 --num-prompts 4 --num-samples 2 --max-new-tokens 8 --scale 0.1 --iterations 2 --train-rows 4"
  TL3B="--tiny llama --num-prompts 4 --num-samples 2 --max-new-tokens 8 --scale 0.1 --iterations 2 --train-rows 2"
else
  STEP="--preset qwen2.5-3b"; RL="--preset qwen3-0.6b"
  LOGITS="--preset qwen2.5-3b --steps 32"; GRPO="--preset qwen2.5-3b --max-new-tokens 512"
  GPQA="--preset qwen2.5-3b --dtype bfloat16 --repetitions 3 --max-new-tokens 256 --prefill-graphs"
  PEER="--preset qwen2.5-3b --dtype bfloat16 --repetitions 3 --max-new-tokens 256"
  # ours_compile_model: the whole model compiled as one graph (CUDA only), its step and first-call cost beside the layers'
  VARIANTS="ours ours_compile_model ours_no_compile ours_masked"
  TL="--preset qwen2.5-0.5b --num-prompts 64 --num-samples 8 --max-new-tokens 256 --iterations 4 --train-rows 64"
  # 3B: smaller micro-batches (the trainer's fp32 log-softmax over a 152k vocabulary is 0.6 GB per 1k tokens)
  TL3B="--preset qwen2.5-3b --num-prompts 64 --num-samples 8 --max-new-tokens 256 --iterations 3 --train-rows 16"
fi
versions
for what in "$@"; do
  case $what in
    tests) step 300 $PY -m pytest -q -x tests/test_span_attention.py tests/test_steppers.py ;;
    step)  step 300 $PY -m rollout_lab.cli bench decode-step $STEP --variants $VARIANTS \
               --out $OUT/decode_step ;;
    rl)    step 420 $PY -m rollout_lab.cli bench rl $RL --paths ${RL_PATHS:-ours ours_no_compile ours_masked} --out $OUT/rl ;;
    # the same model as the next step: its compile finds inductor's cache warm
    logits) step 330 $PY -m rollout_lab.cli bench logits $LOGITS --out $OUT/logits ;;
    grpo)  step 450 $PY -m rollout_lab.cli bench grpo $GRPO ${COSTS:+--costs $COSTS} --reps 1 --out $OUT/grpo ;;
    gpqa)  step ${GPQA_LIMIT:-540} $PY -m rollout_lab.cli sweep $GPQA ${COSTS:+--costs $COSTS} --no-progress --workloads gpqa_diamond_128 \
               --paths nocb bucketed packed auto --out $OUT/sweep_gpqa128_256 ;;
    gpqa_peer) step 300 $PY -m rollout_lab.cli sweep $PEER --no-progress --workloads gpqa_diamond_128 --paths hf_static \
               --out $OUT/sweep_gpqa128_256_hf_static ;;
    trainer_loop) step 420 $PY -m rollout_lab.cli bench trainer-loop $TL ${TL_ARGS:-} --out $OUT/trainer_loop ;;
    trainer_loop_trainer) step 420 $PY -m rollout_lab.cli bench trainer-loop $TL ${TL_ARGS:-} --logprobs-mode trainer \
               --out $OUT/trainer_loop_trainer ;;
    trainer_loop_assign) step 480 $PY -m rollout_lab.cli bench trainer-loop $TL ${TL_ARGS:-} --assign \
               --out $OUT/trainer_loop_assign ;;
    # parameters replaced after each step with gradient checkpointing on: both ways a trainer's step may touch the weights
    trainer_loop_assign_checkpointing) step 480 $PY -m rollout_lab.cli bench trainer-loop $TL ${TL_ARGS:-} --assign \
               --gradient-checkpointing --out $OUT/trainer_loop_assign_checkpointing ;;
    trainer_loop_3b) step 420 $PY -m rollout_lab.cli bench trainer-loop $TL3B ${TL_ARGS:-} --out $OUT/trainer_loop_3b ;;
    *) echo "unknown step $what (tests, step, rl, logits, grpo, gpqa, gpqa_peer, trainer_loop, trainer_loop_trainer, trainer_loop_assign, trainer_loop_assign_checkpointing, trainer_loop_3b)"; exit 2 ;;
  esac
done
