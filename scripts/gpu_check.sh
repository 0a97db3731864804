#!/usr/bin/env bash
# The GPU acceptance check: one command that, on a bare GPU machine with PyTorch (and nvcc, no
# network, no MPI), installs what hvdtrain needs from files carried in the working tree and runs the
# checks of hvdtrain/tools/gpu_check.py on its GPU. One JSON line per check on stdout,
#   {"check": NAME, "status": "pass"|"fail"|"skip", ...numbers, "reason": WHY}
# and exit 1 if any check failed. Without a GPU the CPU-safe checks run and every GPU check prints a
# skip with its reason. Progress goes to stderr.
#
#   scripts/gpu_check.sh build   here, with network: make .device/ (ignored by git; carry it) for the
#                                GPU machine's Python and torch: a Horovod wheel (Gloo + NCCL, no MPI,
#                                CUDA kernels for GPU_CHECK_CC) built by scripts/install.sh from PyPI's
#                                CUDA 13 toolchain, the small wheels that machine lacks, and Horovod's
#                                sdist with cffi for a rebuild there
#   scripts/gpu_check.sh         there (or anywhere): install from .device/ if Horovod is missing, then check
#
# Knobs: GPU_CHECK_PYTHON (3.12), GPU_CHECK_TORCH (2.11.0), GPU_CHECK_CC (90: H100/H200) for build;
#        HVDTRAIN_PYTHON (the interpreter with torch; default .venv's, else python3) for the run.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CARRY=$ROOT/.device
HOROVOD_VERSION=0.28.1
say() { printf '[gpu_check] %s\n' "$*" >&2; }
emit() { printf '{"check": "%s", "status": "%s", %s"reason": "%s"}\n' "$1" "$2" "${4:+$4, }" "$3"; }

build() {
  local pyv=${GPU_CHECK_PYTHON:-3.12} torch=${GPU_CHECK_TORCH:-2.11.0} cc=${GPU_CHECK_CC:-90}
  local cache=${HVDTRAIN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvdtrain}
  local py venv=$cache/venv-device-py${pyv/./}-torch$torch
  # pyenv's shims answer `command -v` for versions that are not selected: try its versions first.
  for py in $(ls "$HOME"/.pyenv/versions/"$pyv"*/bin/python"$pyv" 2>/dev/null | sort -V | tail -1) \
            $(command -v "python$pyv") ""; do
    [ -n "$py" ] && "$py" -c '' 2>/dev/null && break
  done
  [ -n "$py" ] || { say "FAILED: no working python$pyv here (pyenv install $pyv, or set GPU_CHECK_PYTHON)"; exit 2; }
  local empty
  empty=$(mktemp -d)
  say "Horovod for Python $pyv, torch $torch (CUDA 13.0), Gloo + NCCL, kernels for sm_$cc (first time: GBs of wheels, minutes of compiling)"
  # An empty find-links folder: a local CPU wheel of the same torch must not win over PyPI's CUDA build.
  HVDTRAIN_PYTHON=$py HVDTRAIN_VENV=$venv HVDTRAIN_TORCH=$torch HVDTRAIN_CUDA=cu130 HVDTRAIN_WITHOUT_MPI=1 \
    HOROVOD_BUILD_CUDA_CC_LIST=$cc HVDTRAIN_LOG_DIR=$cache/logs-device PIP_FIND_LINKS=$empty \
    "$ROOT/scripts/install.sh" >&2
  rm -rf "$empty" "$CARRY"
  mkdir -p "$CARRY/wheels" "$CARRY/build"
  local key
  key=$(cat "$venv/.horovod-key")
  cp "$cache/$key"/horovod-*.whl "$CARRY/wheels/"
  local plat=(--only-binary=:all: --python-version "$pyv" --implementation cp --platform manylinux_2_28_x86_64
              --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
  # The GPU machine has torch, numpy, scikit-learn, tqdm, tensorboard, matplotlib, pyyaml and psutil
  # (device KINDS list); mnist1d is pure Python. cffi (and pycparser) only serve a rebuild there.
  "$venv/bin/pip" download -q --no-deps "${plat[@]}" -d "$CARRY/wheels" "mnist1d>=0.0.2" >&2
  "$venv/bin/pip" download -q --no-deps "${plat[@]}" -d "$CARRY/build" cffi pycparser >&2
  "$venv/bin/pip" download -q --no-deps --no-binary :all: -d "$CARRY/build" "horovod==$HOROVOD_VERSION" >&2
  "$venv/bin/python" - "$CARRY/manifest.json" "$key" <<'EOF'
import json, sys, torch
json.dump({"python": "%d.%d" % sys.version_info[:2], "torch": torch.__version__, "cuda": torch.version.cuda,
           "horovod_key": sys.argv[2]}, open(sys.argv[1], "w"), indent=1)
EOF
  say "carry $CARRY ($(du -sh "$CARRY" | cut -f1)): $(ls "$CARRY"/wheels "$CARRY"/build | tr '\n' ' ')"
}

python_with_torch() {
  if [ -n "${HVDTRAIN_PYTHON:-}" ]; then echo "$HVDTRAIN_PYTHON"
  elif [ -x "$ROOT/.venv/bin/python" ]; then echo "$ROOT/.venv/bin/python"
  else command -v python3
  fi
}

# This machine's CUDA toolkit: the one nvcc belongs to (it may be a wrapper script on PATH).
cuda_home_here() {
  local nvcc h
  nvcc=$(command -v nvcc || true)
  for h in "${CUDA_HOME:-}" "${CUDA_PATH:-}" /usr/local/cuda ${nvcc:+"$(dirname "$(dirname "$(readlink -f "$nvcc")")")"}; do
    if [ -n "$h" ] && [ -x "$h/bin/nvcc" ] && [ -f "$h/include/cuda_runtime.h" ]; then echo "$h"; return 0; fi
  done
  return 1
}

# Horovod from .device/: the carried wheel when this Python and torch are the ones it was built for,
# else a build from the carried sdist with this machine's nvcc and torch's NCCL (the same patches).
install_carried() {
  local py=$1 site=$2 t0=$SECONDS how
  [ -f "$CARRY/manifest.json" ] || { emit install fail "Horovod is not importable and there is no .device/ (run scripts/gpu_check.sh build where pip works, and carry .device)"; return 1; }
  mkdir -p "$site"
  "$py" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$CARRY"/wheels/mnist1d-*.whl >&2
  local here want
  # Python minor version, torch's public version and its CUDA: PyPI's 2.11.0 is PyTorch's 2.11.0+cu130.
  here=$("$py" -c 'import sys, torch; print("%d.%d" % sys.version_info[:2], torch.__version__.split("+")[0], torch.version.cuda)')
  want=$("$py" -c 'import json, sys; m = json.load(open(sys.argv[1])); print(m["python"], m["torch"].split("+")[0], m["cuda"])' \
    "$CARRY/manifest.json")
  if [ "$here" = "$want" ]; then
    how="carried wheel ($want)"
    "$py" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$CARRY"/wheels/horovod-*.whl >&2
  else
    how="built here from the sdist (this machine has $here; the carried wheel is for $want)"
    say "rebuilding Horovod: $how"
    "$py" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$CARRY"/build/*.whl >&2
    local home cc out
    home=$(cuda_home_here) || { emit install fail "no CUDA toolkit (nvcc and cuda_runtime.h) to rebuild Horovod for $here"; return 1; }
    cc=$(PYTHONPATH=$site "$py" -c 'import torch; print("%d%d" % torch.cuda.get_device_capability())' 2>/dev/null || echo 90)
    out=$(mktemp -d)
    PYTHONPATH=$site HVDTRAIN_PYTHON=$py HVDTRAIN_CUDA=cu130 HVDTRAIN_WITHOUT_MPI=1 HVDTRAIN_CACHE=$out/cache \
      HVDTRAIN_LOG_DIR=$out/logs HVDTRAIN_HOROVOD_SDIST=$(ls "$CARRY"/build/horovod-*.tar.gz) \
      HOROVOD_CUDA_HOME=$home HOROVOD_BUILD_CUDA_CC_LIST=$cc \
      "$ROOT/scripts/install.sh" wheel "$out/wheel" >&2 \
      || { emit install fail "the Horovod build failed (log: $out/logs/install.log)"; return 1; }
    "$py" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$out"/wheel/horovod-*.whl >&2
  fi
  emit install pass "" "\"how\": \"$how\", \"seconds\": $((SECONDS - t0))"
}

run() {
  local py site
  py=$(python_with_torch)
  export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
  if ! "$py" -c 'import horovod.torch' 2>/dev/null; then
    # Installed into a folder of this interpreter's own, put on the path only here.
    site=/tmp/hvdtrain-device-site-$("$py" -c 'import sys; print("py%d%d" % sys.version_info[:2])')
    rm -rf "$site"
    install_carried "$py" "$site" || exit 1
    export PYTHONPATH=$PYTHONPATH:$site
  fi
  cd "$ROOT"
  exec "$py" -m hvdtrain.tools.gpu_check "$@"
}

case "${1:-}" in
  build) shift; build "$@" ;;
  *) run "$@" ;;
esac
