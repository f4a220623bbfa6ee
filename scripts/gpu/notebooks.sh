#!/usr/bin/env bash
# The notebooks on the H200 (issue 18): papermill executes 01_calibrate, 02_bucket_choices,
# 03_latency_tables and 04_adaptation with `rollout-lab notebooks --device cuda --preset qwen2.5-3b
# --dtype bfloat16`, one notebook per step, so that each step fits one 10-minute device call.
# The device has no papermill or Jupyter: the wheels of scripts/gpu/notebook_wheels.txt travel in
# the ignored folder .whl/ (that file says how to download them) and install into /tmp/site.
#   OUT=/tmp/nbcheck TINY=1 PY=<python3.12> bash scripts/gpu/notebooks.sh 01 02 03 04   # tiny CPU check
#   run(carry=[".whl"], command="OUT=$OUT ROLLOUT_LAB_GIT_SHA=<sha> bash scripts/gpu/notebooks.sh 01")
#   ... notebooks.sh 02 ; ... notebooks.sh 03 ; ... notebooks.sh 04                    # the next calls
# Each step writes its own workspace /tmp/nb_ws/<step> (figures/, data/tables/, data/calibration/,
# data/results/, build/notebooks/ with the executed notebook, and log.txt) and packs it into
# $OUT/notebooks_<step>.tar.gz (the device returns at most 8 files, 2 folders deep).
# 02 and 03 price the buckets and Auto with the calibration of 01: $COSTS if set, else the one 01
# wrote in this call, else data/calibration/<preset>_<dtype>_<device>.json of the checkout (commit
# what 01 brought back there before the next call), else the reference coefficients (said so).
# PARAMS_01 .. PARAMS_04 add `--param` overrides to one step (shell words, quotes kept), e.g.
#   PARAMS_03="--param \"03:workloads=['long_tail', 'spread']\" --param 03:repetitions=2"
# PRESET=qwen3-0.6b runs the RL-shape model instead. TINY CPU times, 2026-12-03 (2 busy cores, Python
# 3.12 with the carried wheels only): install 3 s, 01 11-34 s, 02 12 s, 03 45-65 s, 04 12 s.
source "$(dirname "$0")/common.sh"  # set -u, OUT, PY, step (PYTHONPATH is set below)
SITE=${SITE:-/tmp/site}
WS=${WS:-/tmp/nb_ws}

# The carried wheels, then a python3 kernelspec for this very interpreter, first on JUPYTER_PATH (so
# no other python3 kernel on the machine can be picked); the kernel inherits PYTHONPATH.
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl || exit 1
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false JUPYTER_PLATFORM_DIRS=1 MPLBACKEND=Agg
$PY -m ipykernel install --prefix /tmp/jk --name python3 >/dev/null 2>&1 || exit 1
export JUPYTER_PATH=/tmp/jk/share/jupyter
$PY -c "import sys, psutil, torch, transformers, papermill; from jupyter_client.kernelspec import KernelSpecManager as K
print(sys.version.split()[0], torch.__version__, transformers.__version__, 'papermill', papermill.__version__, 'psutil', psutil.__version__,
      torch.cuda.is_available() and torch.cuda.get_device_name()); k = K().get_kernel_spec('python3'); print('kernel python3:', k.resource_dir, k.argv[0])"

if [ -n "${TINY:-}" ]; then
  M=""; STEM=tiny-qwen2_float32_cpu; KV=""
else
  PRESET=${PRESET:-qwen2.5-3b}; M="--device cuda --preset $PRESET --dtype bfloat16"; STEM=${PRESET}_bfloat16_cuda
  KV="--param 02:kv_dtype=bfloat16"  # 02 declares kv_dtype, not dtype: the runner leaves it at float32
fi
costs() {  # the --param that points $1 at the calibration, or nothing
  local file=${COSTS:-}
  [ -z "$file" ] && [ -f "$WS/01/data/calibration/$STEM.json" ] && file=$WS/01/data/calibration/$STEM.json
  [ -z "$file" ] && [ -f "data/calibration/$STEM.json" ] && file=$PWD/data/calibration/$STEM.json
  if [ -n "$file" ]; then echo "--param \"$1:cost_file='$file'\""; else echo "   no calibration $STEM.json: reference coefficients" >&2; fi
}
notebook() {  # notebook(step, limit, more args): run one notebook into its own workspace and pack it
  local n=$1 limit=$2 start=$SECONDS; shift 2
  rm -rf "${WS:?}/$n"; mkdir -p "$WS/$n"
  echo "== notebook $n ($(date +%T))"
  timeout "$limit" $PY -m rollout_lab.cli notebooks --only "$n" $M --out-dir "$WS/$n" "$@" >"$WS/$n/log.txt" 2>&1
  local rc=$?
  tail -n 30 "$WS/$n/log.txt"; echo "== rc $rc in $((SECONDS - start)) s"
  tar -C "$WS/$n" -czf "$OUT/notebooks_$n.tar.gz" . && ls -la "$OUT/notebooks_$n.tar.gz"
}
for what in "$@"; do
  case $what in
    01) eval "notebook 01 560 ${PARAMS_01:-}" ;;
    02) eval "notebook 02 300 $(costs 02) $KV ${PARAMS_02:-}" ;;
    03) eval "notebook 03 560 $(costs 03) ${PARAMS_03:-}" ;;
    04) eval "notebook 04 560 ${PARAMS_04:-}" ;;
    help) step 60 $PY -m rollout_lab.cli notebooks --help ;;
    *) echo "unknown step $what (01, 02, 03, 04, help)"; exit 2 ;;
  esac
done
