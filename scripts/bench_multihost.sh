#!/usr/bin/env bash
# Multi-host benchmark matrix on the namespace testbed: for each host count (default 2 3) and link rate
# (default 200mbit 1gbit): TCP goodput, a 64 MiB allreduce per codec (busbw also as a fraction of that
# goodput) and training throughput at 1..N ranks. One JSON line per result on stdout (and --out FILE).
#
#   sudo scripts/bench_multihost.sh [--hosts 2,3] [--rates 200mbit,1gbit] [--controllers gloo,mpi] \
#        [--iters 5] [--task synthetic] [--steps 10] [--set key=value] [--out results.jsonl]
#
# Needs root (network namespaces). Uses HVD_TESTBED_PREFIX (default hvb here), so it does not touch a
# testbed someone else has up under another prefix. The testbed is torn down on exit, error or Ctrl-C.
# Details and the figures measured: docs/compression.md.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export HVD_TESTBED_PREFIX=${HVD_TESTBED_PREFIX:-hvb}
PY=${HVDTRAIN_PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=$(command -v python3)
trap '"$ROOT/scripts/testbed.sh" down >/dev/null 2>&1 || true' EXIT
trap 'exit 130' INT TERM
cd "$ROOT"   # horovodrun starts remote ranks in the same working directory
"$PY" "$ROOT/benchmarks/multihost.py" "$@"
