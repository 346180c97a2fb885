#!/usr/bin/env bash
# Every GPU test there is, in both completion modes, with one tally at the end (issue 44):
# tests/gpu and every GPU test of tests/torch (`-m gpu`) at NP ranks, a GPU per rank where
# there are enough; tests/gpu again with every rank on one GPU (the CUDA IPC path and the
# tests that need ranks sharing a GPU); tests/gpu at 1 rank (NCCL alone; the watchdog's
# injected failure); the tests that start 2-rank hvdliterun jobs of their own (a rank
# SIGKILLed or raising inside an NCCL collective and during a captured step's replays; the
# captured-step example). Each step under `timeout`, the whole run inside BUDGET_S seconds.
#
#   NP=2 scripts/gpu/gpu_tests.sh [STEP|GROUP ...]        # NP=4 on a 4-GPU host
#   python3 scripts/gpu/tally.py OUT [OUT ...]            # the tally again, over several runs
#
# Steps (`all`, the default, runs them in this order; groups `nccl` and `rest` split it in two
# device commands when one is not enough; run both with the same HVDLITE_BENCH_COMMIT and
# tally the two OUT folders together; group `suite` is issue 38's "GPU suite in both modes and
# the watchdog": nccl's steps and `jobs`, about 300 s at 2 GPUs, so three consecutive runs are
# `for k in 1 2 3; do OUT=$OUT/run$k scripts/gpu/gpu_tests.sh suite; done` over two device
# commands; a run is green when every step exited 0 and no test failed (its tally says
# INCOMPLETE for the tests only the other steps run, and exits 3)):
#   gpu-sync gpu-async        tests/gpu at NP ranks, HVDLITE_ENABLE_ASYNC_COMPLETION=0 / 1  } nccl
#   torch-sync torch-async    `-m gpu tests/torch` at NP ranks (the captured step too)      }
#   shared-sync shared-async  tests/gpu at NP ranks, CUDA_VISIBLE_DEVICES=0: IPC           } rest
#   shared-torch-sync, -async `-m gpu tests/torch` likewise (a captured step over IPC flags) }
#   np1-sync np1-async        tests/gpu at 1 rank                                          }
#   jobs                      tests/gpu/test_gpu_ipc_death.py tests/test_captured_step.py,  }
#                             outside mpirun (they start their own jobs, of NP ranks)      }
# On one GPU the shared steps are the gpu steps again and are left out.
#
# Kept under $OUT (default /tmp/hvdlite_gpu_tests): gpu_tests.log (everything), <step>.log
# (each step's output, `-s -rs`: the tests' printed numbers and every skip's reason),
# <step>/rank<R>.json (each rank's tally: counts, every test's outcome, every skip's reason;
# tests/conftest.py writes it), <step>/meta.json (command, exit status, seconds), tally.txt and
# tally.json (scripts/gpu/tally.py). The tally prints, per step, each rank count and mode, the
# exit status and pytest's counts; the skips by reason; the line each rank printed for the
# other-device test (which way of reading its result failed); then, over all steps, every
# test that failed anywhere and every test that ran in no step (skipped wherever collected),
# with the reasons, and per completion mode the tests that ran in neither of its steps.
#
# Environment: NP (2), OUT, BUDGET_S (560), PYTHON (python3), WHEELS (build/wheels: the
# cuda-bindings and cuda-pathfinder wheels installed when cuda-python is missing),
# HVDLITE_BENCH_COMMIT (the commit the tree is: the device copy's .git can lag behind it),
# LAUNCH (a launcher prefix replacing the system Open MPI's mpirun, e.g. ".venv/bin/mpiexec";
# -n NP is appended).
# Exit status 0 only if every step ran and exited 0, and the tally's verdict is OK: no test
# failed and every test ran in some step (INCOMPLETE, tally.py's exit 3, names those that did
# not; run the other group and tally both folders: `python3 scripts/gpu/tally.py OUT1 OUT2`).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2
OUT="${OUT:-/tmp/hvdlite_gpu_tests}"
mkdir -p "$OUT" || exit 2
exec > >(tee -a "$OUT/gpu_tests.log") 2>&1

# The machine's rule: NVLink multicast stays off.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}"
export HVDLITE_BENCH_COMMIT="${HVDLITE_BENCH_COMMIT:-}"
export NP="${NP:-2}"
PY="${PYTHON:-python3}"
BUDGET_S="${BUDGET_S:-560}"
ALL=(gpu-sync gpu-async torch-sync torch-async shared-sync shared-async shared-torch-sync
     shared-torch-async np1-sync np1-async jobs)

STEPS=()
(($#)) || set -- all
for a in "$@"; do
  case $a in
    all) STEPS+=("${ALL[@]}") ;;
    nccl) STEPS+=(gpu-sync gpu-async torch-sync torch-async) ;;
    suite) STEPS+=(gpu-sync gpu-async torch-sync torch-async jobs) ;;
    rest) STEPS+=(shared-sync shared-async shared-torch-sync shared-torch-async np1-sync np1-async
                  jobs) ;;
    gpu-sync|gpu-async|torch-sync|torch-async|shared-sync|shared-async|shared-torch-sync| \
    shared-torch-async|np1-sync|np1-async|jobs)
      STEPS+=("$a") ;;
    *) echo "unknown step or group '$a'; steps: ${ALL[*]}; groups: all nccl rest suite" >&2
       exit 2 ;;
  esac
done

GPUS=0
DEVICE="no nvidia-smi"
if command -v nvidia-smi >/dev/null; then
  GPUS=$(timeout 30 nvidia-smi -L | grep -c '^GPU')
  DEVICE="$GPUS x $(timeout 30 nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
fi
# A CUDA_VISIBLE_DEVICES given from outside (two runs side by side on disjoint GPUs of one
# host) is the run's set of GPUs: its count, and its first GPU for the shared steps.
FIRST_GPU=0
if [[ -n "${CUDA_VISIBLE_DEVICES:-}" ]]; then
  IFS=, read -r -a _vis <<< "$CUDA_VISIBLE_DEVICES"
  GPUS=${#_vis[@]} FIRST_GPU=${_vis[0]}
  DEVICE="$DEVICE, CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES"
fi
TREE="${HVDLITE_BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
if [[ -z "$HVDLITE_BENCH_COMMIT" ]] \
   && [[ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]]; then
  TREE="$TREE (dirty)"
fi

# hvdlite[gpu]'s cuda-python (the background thread's isolation from other threads' graph
# captures): a machine with no index to install from takes it from WHEELS (default
# build/wheels, where the caller put the wheels for its Python) if it is missing.
WHEELS="${WHEELS:-build/wheels}"
if ! "$PY" -c "import cuda.bindings" 2>/dev/null \
   && compgen -G "$WHEELS/cuda_bindings-*.whl" >/dev/null; then
  timeout 120 "$PY" -m pip install -q --no-index --no-deps "$WHEELS"/cuda_*.whl 2>&1 | tail -2
fi
CUDA_PYTHON=$("$PY" -c "import cuda.bindings as b; print(b.__version__)" 2>/dev/null \
              || echo "missing")

echo "=== gpu_tests.sh: NP=$NP, $DEVICE, tree $TREE, steps: ${STEPS[*]}, budget $BUDGET_S s," \
     "OUT=$OUT, cuda-python $CUDA_PYTHON"
date -u
git log -1 --format='git HEAD %h %s' 2>/dev/null
echo "HVDLITE_BENCH_COMMIT=${HVDLITE_BENCH_COMMIT:-(unset: the tree is git HEAD above)}"
{ timeout 30 nvidia-smi -L; timeout 30 nvidia-smi topo -m; } 2>/dev/null
"$PY" - <<'EOF'
import importlib.metadata as md, platform
names = ("cupy-cuda13x", "cupy-cuda12x", "torch", "mpi4py", "numpy", "pytest", "nvtx")
found = []
for name in names:
    try:
        found.append(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        pass
print("python", platform.python_version(), "|", ", ".join(found))
try:
    from cupy.cuda import nccl
    print("NCCL", nccl.get_version())
except Exception as exc:
    print("NCCL: not available:", exc)
EOF
if [[ -z "${LAUNCH:-}" ]]; then mpirun --version 2>/dev/null | head -1; fi
if ((GPUS < NP)); then
  echo "NOTE: $GPUS GPU(s) for NP=$NP ranks: ranks share GPUs (local rank % GPUs), so device" \
       "buckets take CUDA IPC where they do"
fi

launch() {  # launch NP COMMAND... : an MPI job (system Open MPI unless LAUNCH)
  local np=$1 var
  shift
  if [[ -n "${LAUNCH:-}" ]]; then
    # shellcheck disable=SC2086 # LAUNCH is a command prefix, split on purpose
    ${LAUNCH} -n "$np" "$@"
    return
  fi
  local fwd=()
  for var in PATH LD_LIBRARY_PATH PYTHONPATH PYTHONUNBUFFERED NCCL_NVLS_ENABLE \
             TORCH_SYMM_MEM_DISABLE_MULTICAST NVSHMEM_DISABLE_NVLS HVDLITE_BENCH_COMMIT \
             HVDLITE_ENABLE_ASYNC_COMPLETION HVDLITE_TEST_REPORT_DIR CUDA_VISIBLE_DEVICES; do
    [[ -n "${!var+set}" ]] && fwd+=(-x "$var")
  done
  mpirun --allow-run-as-root --oversubscribe --bind-to none -n "$np" "${fwd[@]}" "$@"
}

STATUS=()
STEP_DIRS=()
FAILED=0

step() {  # step NAME LIMIT_S NP|- ASYNC PYTEST_ARGS... : one pytest run, its tally in OUT/NAME
  local name=$1 limit=$2 np=$3 async=$4 left rc t0=$SECONDS
  shift 4
  local dir="$OUT/$name"
  left=$((BUDGET_S - SECONDS - 15))
  if ((left < 40)); then
    STATUS+=("SKIPPED $name (budget of $BUDGET_S s spent): run NP=$NP $0 $name")
    FAILED=$((FAILED + 1))
    return
  fi
  ((limit > left)) && limit=$left
  rm -rf "$dir" && mkdir -p "$dir"
  local cmd=("$PY")
  [[ "$np" != - ]] && cmd+=(-m mpi4py)
  cmd+=(-m pytest -q -s -rs -p no:cacheprovider "$@")
  echo "=== $name (limit $limit s, at $SECONDS s of $BUDGET_S s; ranks: $np; async completion:" \
       "$async; CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-unset}): ${cmd[*]}"
  if [[ "$np" == - ]]; then
    HVDLITE_ENABLE_ASYNC_COMPLETION=$async HVDLITE_TEST_REPORT_DIR="$dir" \
      timeout --kill-after=10 "$limit" "${cmd[@]}" 2>&1 | tee "$OUT/$name.log"
  else
    export -f launch
    HVDLITE_ENABLE_ASYNC_COMPLETION=$async HVDLITE_TEST_REPORT_DIR="$dir" \
      timeout --kill-after=10 "$limit" bash -c 'launch "$@"' _ "$np" "${cmd[@]}" 2>&1 \
      | tee "$OUT/$name.log"
  fi
  rc=${PIPESTATUS[0]}
  "$PY" -c 'import json, sys; print(json.dumps(dict(zip(sys.argv[1::2], sys.argv[2::2]))))' \
    step "$name" ranks "${np/-/1}" launcher "$([[ $np == - ]] && echo none || echo mpi)" \
    async "$async" rc "$rc" seconds "$((SECONDS - t0))" limit "$limit" tree "$TREE" \
    device "$DEVICE" date_utc "$(date -u +%FT%TZ)" \
    cuda_visible_devices "${CUDA_VISIBLE_DEVICES:-all}" command "${cmd[*]}" > "$dir/meta.json"
  STEP_DIRS+=("$dir")
  if ((rc == 124 || rc == 137)); then
    STATUS+=("FAILED  $name: TIMED OUT after $limit s")
  elif ((rc != 0)); then
    STATUS+=("FAILED  $name: exit $rc after $((SECONDS - t0)) s")
  else
    STATUS+=("ok      $name: exit 0 after $((SECONDS - t0)) s")
  fi
  ((rc != 0)) && FAILED=$((FAILED + 1))
  return 0
}

shared() {  # shared NAME LIMIT_S ASYNC PYTEST_ARGS... : every rank on the first GPU (n/a on one)
  local name=$1 limit=$2 async=$3
  shift 3
  if ((GPUS < 2)); then
    STATUS+=("n/a     $name: one GPU, so the steps above already ran the ranks on one GPU")
    return
  fi
  CUDA_VISIBLE_DEVICES=$FIRST_GPU step "$name" "$limit" "$NP" "$async" "$@"
}

for s in "${STEPS[@]}"; do
  case $s in
    gpu-sync) step gpu-sync 280 "$NP" 0 tests/gpu ;;
    gpu-async) step gpu-async 280 "$NP" 1 tests/gpu ;;
    torch-sync) step torch-sync 150 "$NP" 0 -m gpu tests/torch ;;
    torch-async) step torch-async 150 "$NP" 1 -m gpu tests/torch ;;
    shared-sync) shared shared-sync 280 0 tests/gpu ;;
    shared-async) shared shared-async 280 1 tests/gpu ;;
    shared-torch-sync) shared shared-torch-sync 150 0 -m gpu tests/torch ;;
    shared-torch-async) shared shared-torch-async 150 1 -m gpu tests/torch ;;
    np1-sync) step np1-sync 200 1 0 tests/gpu ;;
    np1-async) step np1-async 200 1 1 tests/gpu ;;
    jobs) HVDLITE_TEST_JOB_RANKS=$((NP < 2 ? 2 : NP)) \
            step jobs 300 - 0 tests/gpu/test_gpu_ipc_death.py tests/test_captured_step.py ;;
  esac
done

echo
echo "========================= gpu_tests.sh summary (${SECONDS} s) ========================="
printf '%s\n' "${STATUS[@]}"
TALLY=0
if ((${#STEP_DIRS[@]})); then
  "$PY" scripts/gpu/tally.py --json "$OUT/tally.json" "${STEP_DIRS[@]}" | tee "$OUT/tally.txt"
  TALLY=${PIPESTATUS[0]}
fi
echo "failed or skipped steps: $FAILED; tally exit $TALLY; logs: $OUT/<step>.log," \
     "$OUT/gpu_tests.log"
exit $(( FAILED > 0 || TALLY != 0 ))
