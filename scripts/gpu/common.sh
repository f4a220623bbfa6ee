# What every scripts/gpu/*.sh step runner shares; sourced, not run. It needs OUT (the device tool's
# output folder) and takes PY (default python3). step LIMIT CMD... runs CMD under a time limit,
# showing its last 30 lines and its status; versions prints torch, transformers and the device.
set -u
OUT=${OUT:?set OUT}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PY=${PY:-python3}
step() { local limit=$1; shift; echo "== $* ($(date +%T))"; timeout "$limit" "$@" 2>&1 | tail -n 30; echo "== rc ${PIPESTATUS[0]}"; }
versions() { $PY -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.is_available() and torch.cuda.get_device_name())"; }
