#!/usr/bin/env bash
# Issue 31's T1 set on a two-GPU host (a GPU per rank): one launch per model, every variant in
# rotated interleaved rounds (bench_t1.py), JSON per model in $OUT. Models by argument
# (default: resnet50 resnet18 vit_b_16 gpt2); NP (2), ITERS (30), BPI (3: steps per round),
# T1_EXTRA (extra bench_t1.py arguments), HVDLITE_BENCH_COMMIT (the tree, for the JSON: the
# device copy's git may be older than its files).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2
OUT="${OUT:-/tmp/hvdlite_t1}"
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HVDLITE_BENCH_COMMIT="${HVDLITE_BENCH_COMMIT:-}"
NP="${NP:-2}" ITERS="${ITERS:-30}" BPI="${BPI:-3}"
read -r -a EXTRA <<< "${T1_EXTRA:-}"
(($#)) || set -- resnet50 resnet18 vit_b_16 gpt2
rc=0
for m in "$@"; do
  bs=32; [[ $m == gpt2 ]] && bs=8
  echo "=== T1 $m (batch $bs per GPU, $NP ranks) $(date -u +%T)"
  timeout 560 mpirun --allow-run-as-root --oversubscribe --bind-to none -n "$NP" -x PATH \
    -x LD_LIBRARY_PATH -x PYTHONPATH -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST \
    -x NVSHMEM_DISABLE_NVLS -x PYTHONUNBUFFERED -x HVDLITE_BENCH_COMMIT python3 scripts/gpu/bench_t1.py --np "$NP" \
    --model "$m" --batch-size "$bs" --iters "$ITERS" --batches-per-iter "$BPI" \
    --json "$OUT/t1_$m.json" "${EXTRA[@]}" 2>&1 | grep -v "^\[rank" | tee "$OUT/t1_$m.log" \
    | grep -E "^(target|\| |=== |REFUSED|Traceback|.*Error|FAILED)" || tail -20 "$OUT/t1_$m.log"
  ((PIPESTATUS[0] == 0)) || rc=1
done
exit $rc
