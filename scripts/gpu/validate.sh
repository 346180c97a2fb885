#!/usr/bin/env bash
# Full GPU validation in one device call: tests + example + benchmarks (run_all.sh), then the
# G4 overlap benchmark with the timeline on in both device modes (CPU-sync fallback and
# event-timed), and the smoke pass with NVTX ranges on. Results land in $OUT.
#
#   [NP=1] OUT=/some/dir BUDGET_S=330 bash scripts/gpu/validate.sh [--quick]   # NP: ranks (2)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2
OUT="${OUT:-/tmp/hvdlite_gpu_out}"
mkdir -p "$OUT"
NP="${NP:-2}"
NP="$NP" BUDGET_S="${BUDGET_S:-330}" OUT="$OUT" bash scripts/gpu/run_all.sh "$@" > /dev/null 2>&1
echo "run_all.sh exit $?"

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 CUPY_TF32=1
export HVDLITE_BENCH_COMMIT="${HVDLITE_BENCH_COMMIT:-}"
M=(mpirun --allow-run-as-root --oversubscribe --bind-to none -n "$NP" -x PATH -x LD_LIBRARY_PATH -x PYTHONPATH
   -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST -x NVSHMEM_DISABLE_NVLS
   -x PYTHONUNBUFFERED -x CUPY_TF32 -x HVDLITE_TIMELINE_DEVICE_EVENTS -x HVDLITE_NVTX
   -x HVDLITE_BENCH_COMMIT)
{
  echo "=== G4 with the timeline (CPU-sync fallback)"
  HVDLITE_TIMELINE_DEVICE_EVENTS=0 HVDLITE_NVTX=0 timeout 120 "${M[@]}" python3 \
    scripts/gpu/bench_g4.py --np "$NP" --quick --timeline "$OUT/g4_cpusync_{rank}.json" \
    --json "$OUT/g4_tl_cpusync.json"
  echo "=== G4 with the timeline (event-timed)"
  HVDLITE_TIMELINE_DEVICE_EVENTS=1 HVDLITE_NVTX=0 timeout 120 "${M[@]}" python3 \
    scripts/gpu/bench_g4.py --np "$NP" --quick --timeline "$OUT/g4_events_{rank}.json" \
    --json "$OUT/g4_tl_events.json"
  echo "=== smoke with NVTX ranges on"
  HVDLITE_TIMELINE_DEVICE_EVENTS=0 HVDLITE_NVTX=1 timeout 60 "${M[@]}" python3 \
    scripts/gpu/smoke.py
  if command -v ncu >/dev/null; then
    # Nsight Systems is not on this image; Nsight Compute is. With --nvtx it records the NVTX
    # range stack around each profiled kernel and --print-nvtx-rename names the kernel after
    # it: the batched copy kernels must show up under hvdlite's MEMCPY_*_FUSION_BUFFER ranges.
    echo "=== Nsight Compute: NVTX ranges around hvdlite's kernels (1 rank)"
    timeout 120 ncu --nvtx --print-nvtx-rename kernel --kernel-name 'regex:batched|nccl' \
      --launch-count 4 --section LaunchStats python3 scripts/gpu/nvtx_kernels.py
  fi
} > "$OUT/extra.log" 2>&1
echo "extras exit $?"
cd "$OUT" && tar czf results.tgz ./*.json && rm -f ./*.json
