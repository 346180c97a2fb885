#!/usr/bin/env bash
# One command for the GPU machine (2 GPUs, system Open MPI; NP=1 on a one-GPU host): the GPU
# test suite, the CuPy training example, then benchmarks G1-G5 (G6: bench_g3.py --set
# bert_large; G7: head-of-line; T4, the torch layer's cost, where scripts/gpu/bench_t4.py
# exists), each under `timeout`, all output tee'd to $OUT/run_all.log, each benchmark's JSON to
# $OUT/<id>.json, then every table and last every target line of the launch, met or missed,
# with its numbers (summarize.py). Targets follow the rank count: issue 16's at NP=1, the
# 2-GPU ones above.
#
#   NP=1 scripts/gpu/run_all.sh [--quick]   # OUT defaults to /tmp/hvdlite_gpu_out
#
# Exits 0 only if every step exited 0 (a missed target is not a failed step). The whole run
# stays under BUDGET_S seconds: a step gets at most what is left, and steps are skipped once
# less than 20 s remain.
set -uo pipefail

QUICK=()
case "${1:-}" in
  --quick) QUICK=(--quick) ;;
  "") ;;
  *) echo "usage: $0 [--quick]" >&2; exit 2 ;;
esac

cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2
OUT="${OUT:-/tmp/hvdlite_gpu_out}"
mkdir -p "$OUT" || exit 2
exec > >(tee -a "$OUT/run_all.log") 2>&1

# The machine's rule: NVLink multicast stays off.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}"
# Forwarded with -x below, so they must be set; bench_g4.py turns TF32 on for itself.
export CUPY_TF32="${CUPY_TF32:-0}"
export HVDLITE_ENABLE_ASYNC_COMPLETION="${HVDLITE_ENABLE_ASYNC_COMPLETION:-0}"
export PYTHONUNBUFFERED=1
# The commit the tree is (the device copy's .git can lag behind it); empty = ask git.
export HVDLITE_BENCH_COMMIT="${HVDLITE_BENCH_COMMIT:-}"
PY="${PYTHON:-python3}"
# --bind-to none: Open MPI binds each rank to ONE core when -n <= 2, so the training thread,
# hvdlite's background thread and the finalizer would share it (hvdliterun passes this too).
# Ranks: one per GPU, 2 by default (the benchmarks' reference setup); NP=1 on a one-GPU host.
NP="${NP:-2}"
MPIRUN=(mpirun --allow-run-as-root --oversubscribe --bind-to none -n "$NP"
        -x PATH -x LD_LIBRARY_PATH -x PYTHONPATH -x NCCL_NVLS_ENABLE
        -x TORCH_SYMM_MEM_DISABLE_MULTICAST -x NVSHMEM_DISABLE_NVLS -x CUPY_TF32
        -x HVDLITE_ENABLE_ASYNC_COMPLETION -x PYTHONUNBUFFERED -x HVDLITE_BENCH_COMMIT)
BUDGET_S="${BUDGET_S:-510}"
STATUS=()
FAILED=0

run_step() {  # run_step NAME TIMEOUT_S COMMAND...
  local name=$1 limit=$2
  shift 2
  local left=$((BUDGET_S - SECONDS))
  if ((left < 20)); then
    STATUS+=("$name: SKIPPED (time budget spent)")
    FAILED=$((FAILED + 1))
    return
  fi
  ((limit > left)) && limit=$left
  echo "=== $name (limit ${limit} s, at ${SECONDS} s)"
  local t0=$SECONDS rc
  timeout --kill-after=10 "$limit" "$@"
  rc=$?
  ((rc == 124 || rc == 137)) && STATUS+=("$name: TIMED OUT after ${limit} s") \
    || STATUS+=("$name: exit $rc ($((SECONDS - t0)) s)")
  ((rc != 0)) && FAILED=$((FAILED + 1))
  return 0
}

set -x
date -u
timeout 30 nvidia-smi -L
timeout 30 nvidia-smi topo -m
timeout 60 "$PY" -c 'import sys, cupy, mpi4py; from mpi4py import MPI; import cupy.cuda.nccl as n
print(sys.version.split()[0], "cupy", cupy.__version__, "nccl", n.get_version(), "mpi4py",
      mpi4py.__version__, MPI.Get_library_version().splitlines()[0])'
git log -1 --oneline 2>/dev/null

if ls tests/gpu/test_*.py >/dev/null 2>&1; then
  # --tag-output prefixes each line with [job,rank]: the two ranks' tracebacks stay apart.
  run_step "GPU tests" 200 "${MPIRUN[@]}" --tag-output "$PY" -m mpi4py -m pytest tests/gpu -q \
    -rsfEP --tb=long --maxfail=5 -p no:cacheprovider
else
  STATUS+=("GPU tests: none in tests/gpu")
fi
run_step "example mlp_cupy" 45 "${MPIRUN[@]}" "$PY" examples/mlp_cupy.py
run_step "example mlp_cupy --grouped" 45 "${MPIRUN[@]}" "$PY" examples/mlp_cupy.py --grouped \
  --steps 100
run_step G1 60 "${MPIRUN[@]}" "$PY" scripts/gpu/bench_g1.py --np "$NP" "${QUICK[@]}" \
  --json "$OUT/g1.json"
run_step G2 60 "${MPIRUN[@]}" "$PY" scripts/gpu/bench_g2.py --np "$NP" "${QUICK[@]}" \
  --json "$OUT/g2.json"
run_step G3 60 "${MPIRUN[@]}" "$PY" scripts/gpu/bench_g3.py --np "$NP" "${QUICK[@]}" \
  --json "$OUT/g3.json"
run_step G4 90 "${MPIRUN[@]}" "$PY" scripts/gpu/bench_g4.py --np "$NP" "${QUICK[@]}" \
  --json "$OUT/g4.json"
run_step G5 45 "${MPIRUN[@]}" "$PY" scripts/gpu/bench_g5.py --np "$NP" "${QUICK[@]}" \
  --json "$OUT/g5.json"
run_step G6 60 "${MPIRUN[@]}" "$PY" scripts/gpu/bench_g3.py --np "$NP" --set bert_large \
  "${QUICK[@]}" --json "$OUT/g6.json"
run_step G7 60 "${MPIRUN[@]}" "$PY" scripts/gpu/bench_g7.py --np "$NP" "${QUICK[@]}" \
  --json "$OUT/g7.json"
RESULTS=("$OUT"/g1.json "$OUT"/g2.json "$OUT"/g3.json "$OUT"/g4.json "$OUT"/g5.json
         "$OUT"/g6.json "$OUT"/g7.json)
if [[ -f scripts/gpu/bench_t4.py ]]; then
  run_step T4 90 "${MPIRUN[@]}" "$PY" scripts/gpu/bench_t4.py --np "$NP" "${QUICK[@]}" \
    --json "$OUT/t4.json"
  RESULTS+=("$OUT"/t4.json)
fi
set +x

echo
echo "=============================== summary (${SECONDS} s) ==============================="
"$PY" scripts/gpu/summarize.py "${RESULTS[@]}"
echo
printf '%s\n' "${STATUS[@]}"
echo "failed steps: $FAILED; log: $OUT/run_all.log"
exit $((FAILED > 0))
