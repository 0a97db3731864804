#!/usr/bin/env bash
# The whole test suite: install if needed, lint (ruff), type-check (mypy), then unit, distributed
# (horovodrun -np 2, Gloo and MPI, launched from tests/integration with timeouts) and integration
# tests in one pytest run.
# Extra arguments go to pytest, e.g. ./scripts/test.sh -m "not slow" -k resume
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$ROOT/scripts/install.sh"
export PATH="$ROOT/.venv/bin:$PATH"
cd "$ROOT"
ruff check hvdtrain tests setup.py benchmarks
mypy  # hvdtrain/, settings in pyproject.toml
exec python -m pytest tests -q -p no:cacheprovider "$@"
