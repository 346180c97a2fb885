#!/usr/bin/env bash
# The CUDA IPC and device-failure validation (issues 18, 19) on a ONE-GPU host, in one command:
# the GPU suite at 2 ranks sharing the GPU (so IPC) in both completion modes (it includes the
# device bad-input matrix, the device soak with its memory checks, Adasum and the watchdog's
# 1-rank test), tests/torch on CUDA at 2 ranks, the allreduce/allgather/broadcast/alltoall and
# IPC tests at 4 ranks, the bounded-death jobs (and the captured step's:
# tests/test_captured_step.py), and the suite at 1 rank (NCCL) as the regression check. Each
# step under `timeout`; one summary line per step at the end; logs (with the tests' printed
# numbers: `-s`) in $OUT (default /tmp/hvdlite_ipc_out).
#
#   scripts/gpu/ipc_suite.sh [STEP...]   # steps: np2-sync np2-async torch np4 death np1
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2
OUT="${OUT:-/tmp/hvdlite_ipc_out}"
mkdir -p "$OUT" || exit 2
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
STEPS=("$@")
((${#STEPS[@]})) || STEPS=(np2-sync np2-async torch np4 death np1)
STATUS=()
FAILED=0

mpi() {  # mpi NP ASYNC ARGS...
  local np=$1 async=$2
  shift 2
  HVDLITE_ENABLE_ASYNC_COMPLETION=$async mpirun --allow-run-as-root --oversubscribe \
    --bind-to none -n "$np" -x PATH -x LD_LIBRARY_PATH -x PYTHONPATH -x NCCL_NVLS_ENABLE \
    -x TORCH_SYMM_MEM_DISABLE_MULTICAST -x NVSHMEM_DISABLE_NVLS -x PYTHONUNBUFFERED \
    -x HVDLITE_ENABLE_ASYNC_COMPLETION "$PY" -m mpi4py -m pytest -q -s -p no:cacheprovider "$@"
}

export -f mpi
export PY

step() {  # step NAME LIMIT_S COMMAND...
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  echo "=== $name (limit $limit s)"
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  grep -E '^(\[1,0\]<stdout>:)?.*(passed|failed|error)' "$OUT/$name.log" | tail -2
  STATUS+=("$name: exit $rc ($((SECONDS - t0)) s)")
  ((rc != 0)) && FAILED=$((FAILED + 1))
  return 0
}

for s in "${STEPS[@]}"; do
  case $s in
    np2-sync) step np2-sync 280 bash -c 'mpi "$@"' _ 2 0 tests/gpu ;;
    np2-async) step np2-async 280 bash -c 'mpi "$@"' _ 2 1 tests/gpu ;;
    torch) step torch 140 bash -c 'mpi "$@"' _ 2 0 tests/torch/test_gpu_torch.py tests/torch/test_gpu_graphs.py ;;
    np4) step np4 200 bash -c 'mpi "$@"' _ 4 0 tests/gpu/test_gpu_ipc.py tests/gpu/test_gpu_collectives.py \
           -k "not timeline and not scale" ;;
    death) step death 140 "$PY" -m pytest -q -s -p no:cacheprovider tests/gpu/test_gpu_ipc_death.py \
             tests/test_captured_step.py ;;
    np1) step np1 250 bash -c 'mpi "$@"' _ 1 0 tests/gpu ;;
    *) echo "unknown step $s" >&2; exit 2 ;;
  esac
done
printf '%s\n' "${STATUS[@]}"
exit $((FAILED > 0))
