#!/usr/bin/env bash
# The whole test suite: install if needed, lint (ruff), type-check (mypy), then unit, distributed
# (horovodrun -np 2, Gloo and MPI, launched from tests/integration with timeouts) and integration
# tests in one pytest run; then the unit tier under Python 3.10.
# Extra arguments go to pytest, e.g. ./scripts/test.sh -m "not slow" -k resume
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$ROOT/scripts/install.sh"
export PATH="$ROOT/.venv/bin:$PATH"
cd "$ROOT"
ruff check hvdtrain tests setup.py benchmarks
mypy  # hvdtrain/, settings in pyproject.toml
rc=0
python -m pytest tests -q -p no:cacheprovider --durations=25 "$@" || rc=$?
# The unit tier again under the oldest Python that setup.py promises, where the machine has one
# (HVDTRAIN_SKIP_PY310=1 skips it). PyPI's torch for it is the CUDA build (~3 GB, ~30 s here);
# Horovod is built once for it and cached like the main one's.
py310=""
for candidate in python3.10 "$HOME"/.pyenv/versions/3.10*/bin/python; do  # pyenv's shim may not run it
  if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 10)' >/dev/null 2>&1; then py310=$candidate; fi
done
if [ -n "${HVDTRAIN_SKIP_PY310:-}" ]; then
  echo "[test] unit tier under Python 3.10 skipped (HVDTRAIN_SKIP_PY310 is set)"
elif [ -z "$py310" ]; then
  echo "[test] unit tier under Python 3.10 skipped (no Python 3.10 on this machine)"
else
  HVDTRAIN_PYTHON=$py310 HVDTRAIN_VENV="$ROOT/.venv-py310" HVDTRAIN_LOG_DIR="$ROOT/.install-logs/py310" \
    "$ROOT/scripts/install.sh"
  echo "[test] unit tier under $("$ROOT/.venv-py310/bin/python" --version)"
  "$ROOT/.venv-py310/bin/python" -m pytest tests/unit -q -p no:cacheprovider || rc=$?
fi
exit $rc
