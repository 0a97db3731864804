#!/usr/bin/env bash
# ZeRO memory on 2 ranks (NP=4: four): one process group per stage (peak RSS is per process), pylm of n_layer
# blocks at width 384, Adam, fp32. Usage: scripts/bench_zero.sh LAYERS STAGE [STAGE...]
# Run under the heavy lock: flock /tmp/hvdtrain-heavy.lock scripts/bench_zero.sh 18 0 1 2
set -euo pipefail
cd "$(dirname "$0")/.."
layers=$1; shift
export OMP_NUM_THREADS=1
# Big frees go back to the OS at once (no dynamic mmap threshold), so peak RSS follows live tensors.
export MALLOC_MMAP_THRESHOLD_=${MALLOC_MMAP_THRESHOLD_:-1048576}
for stage in "$@"; do
  .venv/bin/horovodrun -np "${NP:-2}" --gloo .venv/bin/hvdtrain plan --task pylm --set model.n_layer="$layers" \
    --set model.n_head=6 --set model.n_embd=384 --set data.max_bytes=300000 --set train.batch_size=4 \
    --set comm.bucket_mb="${BUCKET_MB:-25}" \
    --optimizer adam --zero-stage "$stage" --measure --steps 3 --budget-gb 0.5 2>&1 \
    | sed -E 's/^\[[0-9,]+\]<stdout>://' | grep '^{"plan"'
done
