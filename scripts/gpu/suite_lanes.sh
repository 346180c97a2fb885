#!/usr/bin/env bash
# Issue 38's "green in consecutive runs" on a host with 2 x LANES GPUs: LANES runs of the GPU
# suite side by side (scripts/gpu/gpu_tests.sh, NP=2 each, group `suite` unless given), lane k
# on GPUs 2k and 2k+1 with a TMPDIR of its own, then one tally line per lane. Each lane is a
# whole run of its own (two GPUs, a GPU per rank); lanes share the host's cores, so their
# timings are no benchmark. Seen 2026-11-28 on four H200s: two lanes in 302-304 s (run 125).
#
#   LANES=2 OUT=$OUT HVDLITE_BENCH_COMMIT=<tree> scripts/gpu/suite_lanes.sh [STEP|GROUP ...]
#
# Environment: LANES (GPUs / 2), BUDGET_S (480, per lane), OUT, HVDLITE_BENCH_COMMIT, and what
# gpu_tests.sh reads. Logs: OUT/lane<k>/ (gpu_tests.sh's layout) and OUT/lane<k>.out. A lane is
# green when every step ran and exited 0 and no test failed anywhere (gpu_tests.sh itself exits
# 1 also for the INCOMPLETE tally of the 3 tests no 2-GPU launch can run); exit 0 only if
# every lane is green.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2
OUT="${OUT:-/tmp/hvdlite_lanes}"
GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
LANES="${LANES:-$((GPUS / 2))}"
((LANES >= 1 && 2 * LANES <= GPUS)) || { echo "LANES=$LANES needs $((2 * LANES)) GPUs, $GPUS here" >&2; exit 2; }
(($#)) || set -- suite
pids=()
for ((k = 0; k < LANES; k++)); do
  mkdir -p "$OUT/lane$k/tmp"
  CUDA_VISIBLE_DEVICES=$((2 * k)),$((2 * k + 1)) TMPDIR="$OUT/lane$k/tmp" NP=2 \
    BUDGET_S="${BUDGET_S:-480}" OUT="$OUT/lane$k" scripts/gpu/gpu_tests.sh "$@" \
    > "$OUT/lane$k.out" 2>&1 &
  pids+=($!)
done
rc=0
for k in "${!pids[@]}"; do
  wait "${pids[$k]}"; r=$?
  echo "lane $k (GPUs $((2 * k)),$((2 * k + 1))): gpu_tests.sh exit $r"
  grep -E "^(ok|FAILED|SKIPPED) |^distinct tests|^GPU tests" "$OUT/lane$k.out" | sed 's/^/  /'
  if grep -q "^failed or skipped steps: 0;" "$OUT/lane$k.out" \
     && grep -q "failed or errored in some step: 0;" "$OUT/lane$k.out"; then
    echo "  lane $k: green"
  else
    echo "  lane $k: NOT green (exit $r)"; rc=1
  fi
  rm -rf "$OUT/lane$k/tmp"
done
exit $rc
