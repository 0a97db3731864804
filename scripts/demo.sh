#!/usr/bin/env bash
# Install if needed, then train the digits CNN on 2 ranks with hvdtrain launch (about a minute on 2 cores).
#   HVDTRAIN_DEMO_NP   ranks (default 2)          HVDTRAIN_DEMO_OUT   run folder (default runs/digits-demo)
# Extra arguments go to `hvdtrain train`, e.g. ./scripts/demo.sh --set train.epochs=5
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$ROOT/scripts/install.sh"
export PATH="$ROOT/.venv/bin:$PATH"
NP=${HVDTRAIN_DEMO_NP:-2}
OUT=${HVDTRAIN_DEMO_OUT:-$ROOT/runs/digits-demo}
rm -rf "$OUT"
cd "$ROOT"
start=$(date +%s)
hvdtrain launch -np "$NP" -- hvdtrain train --config configs/digits.yaml --out "$OUT" --set log.progress=false "$@"
echo "demo: $NP ranks, $(( $(date +%s) - start )) s; metrics in $OUT/metrics.jsonl, TensorBoard in $OUT/tb"
