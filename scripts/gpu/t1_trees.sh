#!/usr/bin/env bash
# T1 (the default step) and T5 (make_graphed_step) of two trees in alternating launches on one
# machine (issue 38: "no slower than <commit>"): this tree, and an older one unpacked under
# BASE_DIR (its own hvdlite and scripts), each launch the tree's own scripts/gpu/bench_t1.py
# with the same arguments. Compare ratios within a launch (step / plain, captured / flat):
# the machine drifts between launches on host-bound eager models.
#
#   mkdir -p build/base && git archive 3c8cd4c hvdlite scripts | tar -x -C build/base
#   BASE_DIR=build/base BASE_COMMIT=3c8cd4c OUT=$OUT scripts/gpu/t1_trees.sh resnet50 gpt2
#
# Environment: NP (2), ROUNDS (2: launches per tree and model, alternating new, base, new,
# base), ITERS (8), LIMIT_S (500: no launch starts after this many seconds), T1_ARGS (the
# benchmark's arguments after --model/--batch-size; default: eager model, the captured steps).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2
: "${BASE_DIR:?BASE_DIR: the older tree, unpacked}" "${OUT:=/tmp/hvdlite_t1_trees}"
BASE_DIR=$(cd "$BASE_DIR" && pwd) || exit 2
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
NP="${NP:-2}" ROUNDS="${ROUNDS:-2}" ITERS="${ITERS:-8}" LIMIT_S="${LIMIT_S:-500}"
read -r -a ARGS <<< "${T1_ARGS:---compile off --captured --variants hvd_g,flat_g --no-neg}"
NEW_COMMIT="${HVDLITE_BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
(($#)) || set -- resnet50 gpt2
T0=$(date +%s) i=0 rc=0
for ((round = 0; round < ROUNDS; round++)); do
  for m in "$@"; do
    for tree in new base; do
      i=$((i + 1))
      if (($(date +%s) - T0 > LIMIT_S)); then echo "stop: $LIMIT_S s spent before launch $i"; exit $rc; fi
      root=$PWD commit=$NEW_COMMIT
      [[ $tree == base ]] && root=$BASE_DIR commit=${BASE_COMMIT:-base}
      bs=32; [[ $m == gpt2 ]] && bs=8
      log="$OUT/t1_${i}_${m}_${tree}"
      echo "=== $i $m $tree ($commit) $(date -u +%T)"
      (cd "$root" && HVDLITE_BENCH_COMMIT=$commit timeout 240 mpirun --allow-run-as-root \
        --oversubscribe --bind-to none -n "$NP" -x PATH -x LD_LIBRARY_PATH -x PYTHONPATH="$root" \
        -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST -x NVSHMEM_DISABLE_NVLS \
        -x PYTHONUNBUFFERED -x HVDLITE_BENCH_COMMIT python3 scripts/gpu/bench_t1.py --np "$NP" \
        --model "$m" --batch-size "$bs" --iters "$ITERS" --batches-per-iter 3 --warmup 5 \
        --check-steps 4 --json "$log.json" "${ARGS[@]}") > "$log.log" 2>&1 || rc=1
      grep -E "^\| (plain|hvdlite Distr|torch DDP|captured)" "$log.log" | cut -c1-150
    done
  done
done
exit $rc
