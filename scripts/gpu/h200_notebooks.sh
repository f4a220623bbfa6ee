#!/usr/bin/env bash
# The notebooks on the H200 (issue 18): papermill executes 01_calibrate, 02_bucket_choices,
# 03_latency_tables and 04_adaptation with `rollout-lab notebooks --device cuda --preset qwen2.5-3b
# --dtype bfloat16` (the runner gives each the GPU settings of the README's records: compiled prefill
# graphs, buckets priced at the class ladder, bf16 KV), one notebook per step.
# The device has no papermill or Jupyter: the wheels of scripts/gpu/notebook_wheels.txt travel in
# the ignored folder .whl/ (that file says how to download them) and install into /tmp/site.
#   OUT=/tmp/nbcheck TINY=1 PY=.venv/bin/python bash scripts/gpu/h200_notebooks.sh 01 02 peer 03 04   # tiny CPU check
#   run(carry=[".whl"], command="OUT=$OUT DEADLINE=540 ROLLOUT_LAB_GIT_SHA=<sha> bash scripts/gpu/h200_notebooks.sh 01 02")
#   ... COSTS=<calibration> bash scripts/gpu/h200_notebooks.sh peer 03 ; ... h200_notebooks.sh 04   # the next calls
# Each notebook step writes its own workspace /tmp/nb_ws/<step> (figures/, data/tables/,
# data/calibration/, data/results/, build/notebooks/ with the executed notebook, and log.txt) and
# packs it into $OUT/notebooks_<step>.tar.gz (the device returns at most 8 files, 2 folders deep).
# `peer` sweeps HF's static cache + compile over 03's workloads in a process of its own (its CUDA-graph
# trees break our captures in a shared one) into $OUT/sweep_hf_static.json, which 03 then joins.
# 03 measures the seed's five workloads and GSM8K 32 (WORKLOADS_03) with every route and
# generate_batch at 3 rounds, and renders the committed H200 records of the other workloads (the RL
# shape, GRPO, GPQA-like 128 x 256, the decode step, the prefill-route crossing) beside them, all in
# its whole table.
# 02 and 03 price the buckets and Auto with the calibration of 01: $COSTS if set, else the one 01
# wrote in this call, else data/calibration/<preset>_<dtype>_<device>_notebook-01.json of the checkout
# (what 01 brought back, committed under that name where the plain one was taken), else
# <preset>_<dtype>_<device>.json, else the reference coefficients (said so). A calibration of eager
# prefill forwards is refused by 03, which captures them (planner.cost.CHECKED_GRID_FIELDS): on
# 2026-12-04 the plain 3B file (d071360, eager, fixed cost 26.9 ms against 01's 6.85 ms) priced a
# whole 03 run and merged moderate tail's and GSM8K's buckets into one (+29% and +23%).
# PARAMS_01 .. PARAMS_04 add `--param` overrides to one step (shell words, quotes kept), e.g.
#   PARAMS_03="--param 03:repetitions=2"
# DEADLINE=<s> (common.sh) cuts each step's limit to what is left of the call. PRESET=qwen3-0.6b runs
# the RL-shape model instead, and its 03 also measures nano-vllm's RL shape (rl_shape: ours, then HF
# generate_batch). The committed records rendered beside 03's own measurement (RENDER_03) are
# Qwen2.5-3B's, so only that preset's 03 (and TINY's) renders them.
# MORE_03=<more_shape, a dict literal in single quotes, e.g. "{'workloads': ['gpqa_diamond_128'],
# 'max_new_tokens': 256, 'paths': ['nocb', 'bucketed', 'packed', 'auto']}" (name the paths: a GPU
# preset's 03 runs every path, generate_batch included, which 128 x 256 cannot afford in one call)>:
# 03 also measures those workloads at their own generation length (the 3B preset then renders no
# GPQA record), and `peer_more` sweeps HF's static peer of that shape in a process of its own into
# $OUT/sweep_hf_static_more.json, which 03 joins (from an earlier call or a committed record:
# PARAMS_03="--param 03:more_peer_results_file='<record>'"). The committed GPQA-like 128 x 256 record
# (292c263) took 223 s to its bucketed first call (the 128-slot decode compile) and 17 s a nocb call.
# more:<routes>[@<limit>] (e.g. more:hf_generate_batch@220 more:equal_width,aligned@270) sweeps the
# more shape (MORE_03's, else GPQA-like 128 x 256) over those routes, each step a process of its own
# priced and captured as 03's sweep, at MORE_ROUNDS (default 03's rounds) into $OUT/sweep_more_<routes>.json;
# 03 joins them to its GPQA row, measured (MORE_03) or rendered from the committed records (03's own
# GPQA run of e93db6b and HF static; with no more:<routes> in the call, the committed
# ..._gpqa_diamond_128x256_routes-*.json records).
# A 03 too long for one call: run it, commit the sweep it brought back, and run it again with
#   PARAMS_03="--param 03:results_file='data/results/<that sweep>.json'"
# so the second call renders the sweep and measures the rest (the RL shape, GRPO_03).
# TINY CPU times, 2026-12-03 (2 busy cores, Python 3.12 with the carried wheels only): install 3 s,
# 01 11-34 s, 02 12 s, 03 45-65 s, 04 12 s. On the H200:
# - qwen2.5-3b (2026-12-04, git e04b323, inductor's cache of an earlier call carried in): 01 388 s,
#   02 12 s (both in one call), 03 372 s with the committed HF static record as
#   PARAMS_03="--param 03:peer_results_file='<record>'" instead of the peer step (which would not have
#   fitted the same call).
# - qwen3-0.6b (2026-12-04, git bd5476b, cold inductor cache, kept in build/ between warm calls): 01
#   319 s and 02 30 s in one call; 03 with WORKLOADS_03=long_tail spent 367 s on the sweep (each
#   route's first compile) and ran out of its call in generate_batch; again with the sweep as
#   results_file, 456 s (the RL shape: ours 142 s to the first call, HF 254 s).
# - qwen2.5-3b (2026-12-04, git a315127, build/dev9 carried as INDUCTOR_CACHE): peer 157 s with the
#   start; 03 with that record as peer_results_file 434 s; 03 again with its sweep as results_file
#   and GRPO_03="{'max_new_tokens': 512, 'reps': 1}" 336 s.
# - qwen2.5-3b (2026-12-04, build/dev9 carried as INDUCTOR_CACHE), 03 whole in three calls: 03 with the
#   peer record 382 s (git 204468e); 03 with its sweep as results_file and MORE_03 (GPQA-like 128 x 256:
#   bucketed's first call 196 s) 374 s (6c9660a); MORE_ROUNDS=2 more:equal_width,aligned@190 (145 s, its
#   first call 93 s) more:hf_generate_batch@170 (120 s, 35 s a call) 03 (32 s, rendering) 311 s (62dd5c1).
source "$(dirname "$0")/common.sh"  # set -u, OUT, PY, step, capped (PYTHONPATH is set below)
SITE=${SITE:-/tmp/site}
WS=${WS:-/tmp/nb_ws}

# The carried wheels (unless this interpreter has papermill already, as a checkout's .venv does), then a
# python3 kernelspec for this very interpreter, first on JUPYTER_PATH (so no other python3 kernel on
# the machine can be picked); the kernel inherits PYTHONPATH.
$PY -c "import papermill, ipykernel" 2>/dev/null \
  || $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl || exit 1
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false JUPYTER_PLATFORM_DIRS=1 MPLBACKEND=Agg
$PY -m ipykernel install --prefix /tmp/jk --name python3 >/dev/null 2>&1 || exit 1
export JUPYTER_PATH=/tmp/jk/share/jupyter
$PY -c "import sys, psutil, torch, transformers, papermill; from jupyter_client.kernelspec import KernelSpecManager as K
print(sys.version.split()[0], torch.__version__, transformers.__version__, 'papermill', papermill.__version__, 'psutil', psutil.__version__,
      torch.cuda.is_available() and torch.cuda.get_device_name()); k = K().get_kernel_spec('python3'); print('kernel python3:', k.resource_dir, k.argv[0])"

R=data/results  # the committed H200 records of Qwen2.5-3B that its 03 renders beside its own measurement
G=$R/sweep_qwen2.5-3b_bfloat16_cuda_gpqa  # GPQA-like 128 x 256: 03's own (e93db6b), HF static, other routes
MORE_SHAPE=${MORE_03:-"{'workloads': ['gpqa_diamond_128'], 'max_new_tokens': 256}"}  # what more:<routes> sweeps
more_shape() { $PY -c "import ast, sys; d = ast.literal_eval(sys.argv[1]); print(d['max_new_tokens'], *d['workloads'])" "$MORE_SHAPE"; }
more_sweep() {  # more_sweep LIMIT OUT SWEEP-ARGS...: the more shape's sweep into OUT, in a process of its own
  local limit=$1 out=$2 more; shift 2; more=$(more_shape) || exit 2
  step "$limit" $PY -m rollout_lab.cli sweep $SWEEP_M --workloads ${more#* } --max-new-tokens ${more%% *} \
      --no-progress --out "$out" "$@"
}
more_made() { ls "$OUT"/sweep_more_*.json 2>/dev/null; }  # this call's more:<routes> records
render_03() {  # the committed records 03 renders (3B preset only), GPQA joined with this call's more:<routes>
  [ "${PRESET:-qwen2.5-3b}" = qwen2.5-3b ] || return 0
  echo -n "--param \"03:rl_results_file='$R/rl_qwen3-0.6b_bfloat16_cuda_notebook-03.json'\"
    --param 03:decode_step_file='$R/decode_step_qwen2.5-3b_bfloat16_cuda_layers.json'
    --param \"03:prefill_routes_file=['$R/prefill_routes_qwen2.5-3b_bfloat16_cuda.json', '$R/prefill_routes_qwen2.5-3b_bfloat16_cuda_512.json']\" "
  [ -n "${MORE_03:-}" ] && return 0  # 03 measures the more shape itself
  local f files="'${G}_diamond_128x256_notebook-03.json', '${G}128x256_hf_static.json'" routes
  # TINY's records hold the tiny model's prompts, which do not join the 3B ones
  routes=$([ -z "${TINY:-}" ] && more_made); [ -z "$routes" ] && routes=$(ls "${G}"_diamond_128x256_routes-*.json 2>/dev/null)
  for f in $routes; do files="$files, '$f'"; done
  echo -n "--param \"03:more_results_file=[[$files]]\""
}
# GRPO_03=<run_grpo settings, a dict literal in single quotes>: 03 measures GRPO on its model (grpo_shape);
# else the 3B preset's 03 renders the committed record of the one that did (a315127)
if [ -n "${GRPO_03:-}" ]; then GRPO_PARAM="--param \"03:grpo_shape=$GRPO_03\""
elif [ "${PRESET:-qwen2.5-3b}" = qwen2.5-3b ]; then GRPO_PARAM="--param 03:grpo_results_file='$R/grpo_qwen2.5-3b_bfloat16_cuda_notebook-03.json'"
else GRPO_PARAM=""; fi
if [ -n "${TINY:-}" ]; then
  M=""; STEM=tiny-qwen2_float32_cpu; SWEEP_M="--tiny qwen2 --scale 0.25"
  WORKLOADS_03=${WORKLOADS_03:-"long_tail spread"}; NEW=3; ROUNDS=1
else
  PRESET=${PRESET:-qwen2.5-3b}; M="--device cuda --preset $PRESET --dtype bfloat16"; STEM=${PRESET}_bfloat16_cuda
  SWEEP_M="--preset $PRESET --dtype bfloat16"
  WORKLOADS_03=${WORKLOADS_03:-"short_similar long_tail short_tail moderate_tail spread gsm8k_32"}
  NEW=16; ROUNDS=3  # 16 new tokens and 3 rounds, as the README's records: the step fits one call
  PARAMS_03="--param 03:oracle_max_tokens=0 ${PARAMS_03:-}"  # bf16 token matches on random weights mean nothing
fi
PEER=$OUT/sweep_hf_static
PEER_MORE=$OUT/sweep_hf_static_more
cost_file() {  # the calibration 02, 03 and more:<routes> are priced by (path on stdout), or nothing
  local file=${COSTS:-}
  [ -z "$file" ] && [ -f "$WS/01/data/calibration/$STEM.json" ] && file=$WS/01/data/calibration/$STEM.json
  local kept  # the checkout's: 01's own where the plain name was taken (qwen2.5-3b), else the plain name
  for kept in "data/calibration/${STEM}_notebook-01.json" "data/calibration/$STEM.json"; do
    [ -z "$file" ] && [ -f "$kept" ] && file=$PWD/$kept
  done
  [ -n "$file" ] && echo "$file"; return 0
}
costs() {  # the --param that points $1 at the calibration, or nothing
  local file; file=$(cost_file)
  if [ -n "$file" ]; then echo "--param \"$1:cost_file='$file'\""; else echo "   no calibration $STEM.json: reference coefficients" >&2; fi
}
workloads_03() {  # 03's workloads as a --param, and the peer record to join when this call made one
  echo -n "--param \"03:workloads=[$(printf "'%s', " $WORKLOADS_03)]\""
  [ -f "$PEER.json" ] && echo -n " --param 03:peer_results_file='$PEER.json'"
  [ -n "${MORE_03:-}" ] && echo -n " --param \"03:more_shape=$MORE_03\""
  local peers; peers=$( ([ -f "$PEER_MORE.json" ] && echo "$PEER_MORE.json"; more_made) | sed "s/.*/'&'/" | paste -sd, -)
  [ -n "${MORE_03:-}" ] && [ -n "$peers" ] && echo -n " --param \"03:more_peer_results_file=[$peers]\""
}
notebook() {  # notebook(step, limit, more args): run one notebook into its own workspace and pack it
  local n=$1 limit start=$SECONDS; limit=$(capped "$2" "notebook $n") || return 0; shift 2
  rm -rf "${WS:?}/$n"; mkdir -p "$WS/$n"
  echo "== notebook $n ($(date +%T), limit $limit s)"
  timeout "$limit" $PY -m rollout_lab.cli notebooks --only "$n" $M --out-dir "$WS/$n" "$@" >"$WS/$n/log.txt" 2>&1
  local rc=$?
  tail -n 30 "$WS/$n/log.txt"; echo "== rc $rc in $((SECONDS - start)) s"
  tar -C "$WS/$n" -czf "$OUT/notebooks_$n.tar.gz" . && ls -la "$OUT/notebooks_$n.tar.gz"
}
for what in "$@"; do
  case $what in
    01) eval "notebook 01 540 ${PARAMS_01:-}" ;;
    02) eval "notebook 02 180 $([ -z "${TINY:-}" ] && costs 02) ${PARAMS_02:-}" ;;  # a tiny calibration prices no preset geometry
    peer) step 300 $PY -m rollout_lab.cli sweep $SWEEP_M --workloads $WORKLOADS_03 --paths hf_static \
              --max-new-tokens $NEW --repetitions $ROUNDS --no-progress --out "$PEER" ;;
    peer_more) : "${MORE_03:?peer_more measures the shape of MORE_03: set it}"
               more_sweep 300 "$PEER_MORE" --paths hf_static --repetitions $ROUNDS ;;
    more:*) routes=${what#more:}; limit=${routes#*@}; [ "$limit" = "$routes" ] && limit=300; routes=${routes%@*}
            cost=$(cost_file)
            more_sweep "$limit" "$OUT/sweep_more_${routes//,/-}" --paths ${routes//,/ } \
                --repetitions ${MORE_ROUNDS:-$ROUNDS} --oracle-max-tokens 0 \
                $([ -z "${TINY:-}" ] && echo --prefill-graphs) ${cost:+--costs "$cost"} ;;
    03) eval "notebook 03 540 $(costs 03) $(workloads_03) --param 03:max_new_tokens=$NEW --param 03:repetitions=$ROUNDS \
              $(render_03 | tr '\n' ' ') $GRPO_PARAM ${PARAMS_03:-}" ;;
    04) eval "notebook 04 480 ${PARAMS_04:-}" ;;
    help) step 60 $PY -m rollout_lab.cli notebooks --help ;;
    *) echo "unknown step $what (01, 02, peer, peer_more, more:<routes>[@<limit>], 03, 04, help)"; exit 2 ;;
  esac
done
