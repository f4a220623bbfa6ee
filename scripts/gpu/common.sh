# What every scripts/gpu/*.sh step runner shares; sourced, not run. It needs OUT (the device tool's
# output folder) and takes PY (default python3). step LIMIT CMD... runs CMD under a time limit,
# showing its last 30 lines and its status; versions prints torch, transformers and the device.
# Inductor's compile cache (its Triton kernels included) lives in one folder. A fresh machine starts
# it empty and pays minutes of compiles again, so KEEP_INDUCTOR_CACHE=1 packs it into $OUT on exit as
# parts of at most 15 MiB (the tool brings back 8 files of 16 MiB), and INDUCTOR_CACHE=<folder of
# those parts>, carried in, unpacks them before the steps run.
set -u
OUT=${OUT:?set OUT}
mkdir -p "$OUT" || exit 1  # the steps write their logs and records into it
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PY=${PY:-python3}
# The whole output of each step is kept as $OUT/log_<script>_<n>.txt (the tool shows only the tail of a call).
STEP_N=0
# DEADLINE=<s> caps every step at the seconds left of the script's first DEADLINE seconds, and skips a
# step with under 60 s left, so one device call can run steps back to back and still return its files.
capped() {  # capped LIMIT WHAT: LIMIT cut to what DEADLINE leaves (on stdout); fails, saying so, under 60 s
  local limit=$1 left; [ -z "${DEADLINE:-}" ] && { echo "$limit"; return 0; }
  left=$((DEADLINE - SECONDS)); [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 60 ]; then echo "== skipped, ${left} s left of DEADLINE=$DEADLINE: $2" >&2; return 1; fi
  echo "$limit"; }
step() { local limit; STEP_N=$((STEP_N + 1)); limit=$(capped "$1" "${*:2}") || return 0; shift
  echo "== $* ($(date +%T), limit ${limit} s)"
  timeout "$limit" "$@" 2>&1 | tee "$OUT/log_$(basename "$0" .sh)_$STEP_N.txt" | tail -n 30; echo "== rc ${PIPESTATUS[0]}"
  pack; }
# PACK_TO=<folder> (the device tool's $OUT, with OUT a scratch folder): after every step, all of OUT as
# one PACK_TO/<script>.tgz, replaced whole (written beside, then renamed). The tool brings back 8 files,
# and a call the device's budget cuts runs no exit trap: each finished step's records still come back.
if [ -n "${PACK_TO:-}" ]; then  # an archive of OUT inside OUT would pack itself
  [ -d "$PACK_TO" ] || { echo "PACK_TO=$PACK_TO is not a folder: give the device tool's \$OUT"; exit 2; }
  [ "$(cd "$PACK_TO" && pwd -P)" != "$(cd "$OUT" && pwd -P)" ] \
    || { echo "PACK_TO and OUT are both $OUT: OUT must be a scratch folder of its own (PACK_TO=\$OUT OUT=/tmp/o, in that order: assignments expand left to right)"; exit 2; }
fi
pack() { [ -z "${PACK_TO:-}" ] && return 0; local name; name=$(basename "$0" .sh)
  tar czf "$PACK_TO/$name.tgz.part" -C "$OUT" . && mv "$PACK_TO/$name.tgz.part" "$PACK_TO/$name.tgz"; }
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/rollout_lab_inductor}
if [ -n "${INDUCTOR_CACHE:-}" ]; then
  mkdir -p "$TORCHINDUCTOR_CACHE_DIR" && cat "$INDUCTOR_CACHE"/inductor.tgz.* | tar xzf - -C "$TORCHINDUCTOR_CACHE_DIR" \
    && echo "inductor cache: $(du -sh "$TORCHINDUCTOR_CACHE_DIR" | cut -f1) from $INDUCTOR_CACHE"
fi
keep_inductor_cache() { tar czf - -C "$TORCHINDUCTOR_CACHE_DIR" . | split -b 15m -d - "$OUT"/inductor.tgz.; ls -l "$OUT"/inductor.tgz.*; }
if [ -n "${KEEP_INDUCTOR_CACHE:-}" ]; then trap keep_inductor_cache EXIT; fi
versions() { $PY -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.is_available() and torch.cuda.get_device_name())"; }
