#!/bin/sh
# The GPU check in one command, inside 10 minutes (README.md here). Run from anywhere:
#
#   gpu_check/run.sh [gpu_check.run options]
#
# The results go to $GPU_CHECK_OUT, else $OUT/gpu_check.json, else /tmp/gpu_check.json;
# the wheels come from $WHEELS (default gpu_check/wheels, what gather.sh made); the build log
# is copied beside the results. PYTHON: the interpreter (default python3).
set -u
cd "$(dirname "$0")/.." || exit 1
out=${GPU_CHECK_OUT:-${OUT:-/tmp}/gpu_check.json}
work=${GPU_CHECK_WORK:-/tmp/gpu_check}
timeout -k 10 590 "${PYTHON:-python3}" -m gpu_check.run --wheels "${WHEELS:-gpu_check/wheels}" \
    --work "$work" --out "$out" --deadline 570 "$@"
status=$?
[ -f "$work/build.log" ] && cp "$work/build.log" "$(dirname "$out")/gpu_check-build.log"
exit $status
