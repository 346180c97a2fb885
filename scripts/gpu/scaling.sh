#!/usr/bin/env bash
# Issue 41's scaling on one machine: bench_t1.py for each model at each rank count (a GPU per
# rank: the first N GPUs), then scripts/gpu/scaling.py's per-GPU table of every variant at
# every count. Models by argument (default resnet50); NPS ("1 2 4"), ITERS (8), T1_ARGS
# (default: the captured steps, the captured limit and the flat captured step, and DDP with
# bucket views, beside the default step), LIMIT_S
# (540: no launch starts after this many seconds; what is left is named), OUT.
#
#   NPS="1 2 4" OUT=$OUT scripts/gpu/scaling.sh resnet50
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2
OUT="${OUT:-/tmp/hvdlite_scaling}"
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HVDLITE_BENCH_COMMIT="${HVDLITE_BENCH_COMMIT:-}"
read -r -a NPS <<< "${NPS:-1 2 4}"
read -r -a ARGS <<< "${T1_ARGS:---captured --variants hvd_g,plain_g,flat_g,ddp_views --no-neg}"
ITERS="${ITERS:-8}" LIMIT_S="${LIMIT_S:-540}"
GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
(($#)) || set -- resnet50
T0=$(date +%s) rc=0 files=()
for m in "$@"; do
  bs=32; [[ $m == gpt2 ]] && bs=8
  for np in "${NPS[@]}"; do
    if ((np > GPUS)); then echo "skip $m at $np ranks: $GPUS GPUs here"; continue; fi
    if (($(date +%s) - T0 > LIMIT_S)); then echo "stop: $LIMIT_S s spent before $m at $np"; rc=1; continue; fi
    visible=$(seq -s, 0 $((np - 1)))
    log="$OUT/t1_${m}_np${np}"
    echo "=== $m at $np ranks (GPUs $visible) $(date -u +%T)"
    CUDA_VISIBLE_DEVICES=$visible timeout 300 mpirun --allow-run-as-root --oversubscribe \
      --bind-to none -n "$np" -x PATH -x LD_LIBRARY_PATH -x PYTHONPATH -x CUDA_VISIBLE_DEVICES \
      -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST -x NVSHMEM_DISABLE_NVLS \
      -x PYTHONUNBUFFERED -x HVDLITE_BENCH_COMMIT python3 scripts/gpu/bench_t1.py --np "$np" \
      --model "$m" --batch-size "$bs" --iters "$ITERS" --batches-per-iter 3 --warmup 5 \
      --json "$log.json" "${ARGS[@]}" > "$log.log" 2>&1 || { rc=1; tail -5 "$log.log"; }
    files+=("$log.json")
  done
done
((${#files[@]})) && { python3 scripts/gpu/scaling.py "${files[@]}" || rc=1; }
exit $rc
