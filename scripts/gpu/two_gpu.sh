#!/usr/bin/env bash
# Every GPU test with one tally is scripts/gpu/gpu_tests.sh (issue 44); this script's test
# steps are a subset of it, kept beside its benchmark steps.
#
# Issue 21 on a two-GPU host (one GPU per rank, NCCL): every step in order, each under
# `timeout`, the whole run inside BUDGET_S seconds (default 540: one device command is at most
# 10 minutes), logs in $OUT (default /tmp/hvdlite_two_gpu_out), then one summary: each step's
# exit status and test tally, and every benchmark target, met or MISSED (summarize.py).
#
#   scripts/gpu/two_gpu.sh [STEP|GROUP ...]      # NP=2 by default; NP=1 to try it on one GPU
#
# Steps, in the order `all` (the default) runs them:
#   suite-sync   the GPU suite (tests/gpu) at NP ranks, sync completion   } group `suite`
#   suite-async  the same with async completion                           }
#   torch        tests/torch/test_gpu_torch.py on CUDA at NP ranks        }
#   validate     scripts/gpu/validate.sh --quick at NP ranks (run_all.sh --quick, G4 timeline..)
#   bench        scripts/gpu/run_all.sh at NP ranks: GPU tests, examples, G1-G7, T4 (full)
#   t1           bench_t1.py: ResNet-50, batch 32, DistributedOptimizer (bucket views off/on)
#                vs DDP vs one GPU                                        } group `t1`
#   t1-g4        bench_t1.py --model g4: T2 on G4's 24 x Linear(4096) stack }
#   ipc          bench_ipc.py: I1-I3, IPC vs NCCL
#   watchdog     tests/gpu/test_gpu_ipc_death.py and tests/test_captured_step.py (nccl with 2+
#                GPUs: a rank killed inside an NCCL collective or during a captured step's
#                replays; the survivor ends within 15 s, the rank named)
# `all` does not fit one device command; run it as, e.g., `suite`, `validate`, `bench`,
# `t1 ipc watchdog` (four commands). Steps left over when the budget is spent are listed as
# SKIPPED with the command that runs them.
#
# At NP=2 the suite steps are scripts/gpu/ipc_suite.sh's np2-sync, np2-async and torch steps
# (with a GPU per rank the ranks take NCCL; on one GPU they share it and take IPC); at other NP
# they run the same pytest commands at NP ranks. The watchdog step is ipc_suite.sh's `death`.
#
# Environment: NP (2), OUT, BUDGET_S (540), PYTHON (python3), HVDLITE_BENCH_COMMIT (the
# commit the tree is, for the JSON), LAUNCH (a launcher prefix to replace mpirun, e.g.
# ".venv/bin/mpiexec" on a CPU box; -n NP is appended), T1_ARGS / IPC_ARGS (extra arguments,
# e.g. "--quick", or "--no-cuda --model tiny --quick" for a CPU run of the t1 step).
# Exit status 0 only if every step that ran exited 0 and none was skipped.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2
OUT="${OUT:-/tmp/hvdlite_two_gpu_out}"
mkdir -p "$OUT" || exit 2
exec > >(tee -a "$OUT/two_gpu.log") 2>&1

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}" CUPY_TF32="${CUPY_TF32:-0}"
export HVDLITE_ENABLE_ASYNC_COMPLETION="${HVDLITE_ENABLE_ASYNC_COMPLETION:-0}"
export HVDLITE_BENCH_COMMIT="${HVDLITE_BENCH_COMMIT:-}"
export NP="${NP:-2}"
PY="${PYTHON:-python3}"
export PYTHON="$PY"
BUDGET_S="${BUDGET_S:-540}"
read -r -a T1_EXTRA <<< "${T1_ARGS:-}"
read -r -a IPC_EXTRA <<< "${IPC_ARGS:-}"
ALL=(suite-sync suite-async torch validate bench t1 t1-g4 ipc watchdog)

STEPS=()
(($#)) || set -- all
for a in "$@"; do
  case $a in
    all) STEPS+=("${ALL[@]}") ;;
    suite) STEPS+=(suite-sync suite-async torch) ;;
    t1) STEPS+=(t1 t1-g4) ;;
    suite-sync|suite-async|torch|validate|bench|t1-g4|ipc|watchdog) STEPS+=("$a") ;;
    *) echo "unknown step or group '$a'; steps: ${ALL[*]}; groups: all suite t1" >&2; exit 2 ;;
  esac
done

launch() {  # launch NP COMMAND... : an MPI job of NP ranks (system Open MPI unless LAUNCH)
  local np=$1
  shift
  if [[ -n "${LAUNCH:-}" ]]; then
    # shellcheck disable=SC2086 # LAUNCH is a command prefix, split on purpose
    ${LAUNCH} -n "$np" "$@"
  else
    mpirun --allow-run-as-root --oversubscribe --bind-to none -n "$np" -x PATH \
      -x LD_LIBRARY_PATH -x PYTHONPATH -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST \
      -x NVSHMEM_DISABLE_NVLS -x PYTHONUNBUFFERED -x CUPY_TF32 -x HVDLITE_ENABLE_ASYNC_COMPLETION \
      -x HVDLITE_BENCH_COMMIT "$@"
  fi
}

pytest_np() {  # pytest_np ASYNC PYTEST_ARGS... : pytest at NP ranks (ipc_suite.sh's command)
  local async=$1
  shift
  HVDLITE_ENABLE_ASYNC_COMPLETION=$async launch "$NP" "$PY" -m mpi4py -m pytest -q \
    -p no:cacheprovider "$@"
}
export -f launch pytest_np
export PY

STATUS=()
RESULTS=()
FAILED=0
RAN=0

run_step() {  # run_step NAME LIMIT_S COMMAND... : under timeout, output to $OUT/NAME.log too
  local name=$1 limit=$2 left rc t0=$SECONDS
  shift 2
  left=$((BUDGET_S - SECONDS - 10))
  RAN=0
  if ((left < 30)); then
    STATUS+=("SKIPPED $name (budget of ${BUDGET_S} s spent): run NP=$NP $0 $name")
    FAILED=$((FAILED + 1))
    return
  fi
  ((limit > left)) && limit=$left
  RAN=1
  echo "=== $name (limit ${limit} s, at ${SECONDS} s of ${BUDGET_S} s)"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  rc=${PIPESTATUS[0]}
  local tally
  tally=$(grep -aoE '[0-9]+ (passed|failed|errors?|skipped)(, [0-9]+ [a-z]+)* in [0-9.]+s' \
          "$OUT/$name.log" | tail -1)
  if ((rc == 124 || rc == 137)); then
    STATUS+=("FAILED  $name: TIMED OUT after ${limit} s ${tally:+($tally)}")
  elif ((rc != 0)); then
    STATUS+=("FAILED  $name: exit $rc after $((SECONDS - t0)) s ${tally:+($tally)}")
  else
    STATUS+=("ok      $name: exit 0 after $((SECONDS - t0)) s ${tally:+($tally)}")
  fi
  ((rc != 0)) && FAILED=$((FAILED + 1))
  return 0
}

suite_step() {  # suite_step NAME LIMIT_S IPC_SUITE_STEP ASYNC PYTEST_ARGS...
  local name=$1 limit=$2 ipc_step=$3 async=$4
  shift 4
  if [[ "$NP" == 2 && -z "${LAUNCH:-}" ]]; then
    run_step "$name" "$limit" env OUT="$OUT/ipc_suite" bash scripts/gpu/ipc_suite.sh "$ipc_step"
  else
    run_step "$name" "$limit" bash -c 'pytest_np "$@"' _ "$async" "$@"
  fi
}

echo "=== two_gpu.sh: NP=$NP, steps: ${STEPS[*]}, budget ${BUDGET_S} s, OUT=$OUT"
date -u
git log -1 --oneline 2>/dev/null
echo "HVDLITE_BENCH_COMMIT=${HVDLITE_BENCH_COMMIT:-(unset: the JSON asks git)}"
if command -v nvidia-smi >/dev/null; then
  timeout 30 nvidia-smi -L
  timeout 30 nvidia-smi topo -m
  GPUS=$(timeout 30 nvidia-smi -L | grep -c '^GPU')
  if ((GPUS < NP)); then
    echo "WARNING: $GPUS GPU(s) for NP=$NP ranks: the ranks share a GPU, so device data takes" \
         "CUDA IPC, not NCCL; t1 refuses (NCCL/DDP need a GPU per rank), ipc measures IPC only" \
         "(no timing claims), the watchdog step checks the IPC path"
  fi
fi

for s in "${STEPS[@]}"; do
  case $s in
    suite-sync) suite_step suite-sync 290 np2-sync 0 tests/gpu ;;
    suite-async) suite_step suite-async 290 np2-async 1 tests/gpu ;;
    torch) suite_step torch 110 torch 0 tests/torch/test_gpu_torch.py tests/torch/test_gpu_graphs.py ;;
    validate)
      rm -f "$OUT"/validate/*.json
      run_step validate 570 env OUT="$OUT/validate" NP="$NP" \
        BUDGET_S=$(( (BUDGET_S - SECONDS) < 330 ? (BUDGET_S - SECONDS) : 330 )) \
        bash scripts/gpu/validate.sh --quick
      ((RAN)) && RESULTS+=("$OUT"/validate/g{1,2,3,4,5,6,7}.json "$OUT"/validate/t4.json) ;;
    bench)
      rm -f "$OUT"/bench/*.json
      run_step bench 570 env OUT="$OUT/bench" NP="$NP" BUDGET_S=$((BUDGET_S - SECONDS - 20)) \
        bash scripts/gpu/run_all.sh
      ((RAN)) && RESULTS+=("$OUT"/bench/g{1,2,3,4,5,6,7}.json "$OUT"/bench/t4.json) ;;
    t1)
      rm -f "$OUT/t1.json"
      run_step t1 240 bash -c 'launch "$@"' _ "$NP" "$PY" scripts/gpu/bench_t1.py --np "$NP" \
        --json "$OUT/t1.json" "${T1_EXTRA[@]}"
      ((RAN)) && RESULTS+=("$OUT/t1.json") ;;
    t1-g4)
      rm -f "$OUT/t1_g4.json"
      run_step t1-g4 200 bash -c 'launch "$@"' _ "$NP" "$PY" scripts/gpu/bench_t1.py \
        --np "$NP" --model g4 --batch-size 1024 --json "$OUT/t1_g4.json" "${T1_EXTRA[@]}"
      ((RAN)) && RESULTS+=("$OUT/t1_g4.json") ;;
    ipc)
      rm -f "$OUT/ipc.json"
      run_step ipc 240 bash -c 'launch "$@"' _ "$NP" "$PY" scripts/gpu/bench_ipc.py --np "$NP" \
        --json "$OUT/ipc.json" "${IPC_EXTRA[@]}"
      ((RAN)) && RESULTS+=("$OUT/ipc.json") ;;
    watchdog)
      run_step watchdog 160 env OUT="$OUT/ipc_suite" bash scripts/gpu/ipc_suite.sh death
      grep -aE '(SIGKILL|raise) \((ipc|nccl)\): the job ended' "$OUT/ipc_suite/death.log" \
        2>/dev/null ;;
  esac
done

echo
echo "=============================== two_gpu.sh summary (${SECONDS} s) ==============================="
if ((${#RESULTS[@]})); then
  # The result files of the benchmark steps that ran (removed before each step, so none is
  # stale); one a benchmark did not write is named MISSING.
  "$PY" scripts/gpu/summarize.py "${RESULTS[@]}"
  echo
fi
printf '%s\n' "${STATUS[@]}"
echo "failed or skipped steps: $FAILED; log: $OUT/two_gpu.log; per step: $OUT/<step>.log"
exit $((FAILED > 0))
