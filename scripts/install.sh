#!/usr/bin/env bash
# Idempotent set-up of hvdtrain: system packages, .venv, PyTorch, Horovod (built once, cached), hvdtrain.
# Sourced-or-run by demo.sh and test.sh. Knobs (environment):
#   HVDTRAIN_PYTHON        interpreter for the venv (default: python3)
#   HVDTRAIN_VENV          venv folder (default: <checkout>/.venv)
#   HVDTRAIN_TORCH         torch version (default: 2.13.0)
#   HVDTRAIN_CUDA          "" for CPU (default), or a CUDA tag such as cu121/cu124/cu126: selects
#                          PyTorch's CUDA wheel index and builds Horovod with NCCL GPU operations
#   HVDTRAIN_TORCH_INDEX   explicit pip index URL for torch (overrides the one HVDTRAIN_CUDA selects)
#   HVDTRAIN_CACHE         wheel cache (default: ${XDG_CACHE_HOME:-~/.cache}/hvdtrain)
#   HVDTRAIN_DRY_RUN=1     print the steps that would run, change nothing
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${HVDTRAIN_PYTHON:-python3}
VENV=${HVDTRAIN_VENV:-$ROOT/.venv}
TORCH_VERSION=${HVDTRAIN_TORCH:-2.13.0}
CUDA=${HVDTRAIN_CUDA:-}
HOROVOD_VERSION=0.28.1
# Bump when the patches applied to the sdist change, so a cached wheel built without them is not reused.
HOROVOD_RECIPE=r3
CACHE=${HVDTRAIN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvdtrain}
DRY=${HVDTRAIN_DRY_RUN:-0}
LOG_DIR=${HVDTRAIN_LOG_DIR:-$ROOT/.install-logs}
mkdir -p "$LOG_DIR"
LOG=$LOG_DIR/install.log
: >"$LOG"

say() { printf '[install] %s\n' "$*"; }
# One line on failure: which step, what to do, where the full log is.
die() { printf '[install] FAILED: %s. %s Full log: %s\n' "$1" "$2" "$LOG" >&2; exit 1; }
# step NAME HINT CMD...: run CMD with its output in the log (or only print it in a dry run).
step() {
  local name=$1 hint=$2; shift 2
  if [ "$DRY" = 1 ]; then printf '[dry-run] %s: %s\n' "$name" "$*"; return 0; fi
  say "$name"
  printf '\n### %s: %s\n' "$name" "$*" >>"$LOG"
  "$@" >>"$LOG" 2>&1 || die "$name" "$hint"
}

system_packages() {
  local need=() cmds=(mpirun cmake g++ make)
  for c in "${cmds[@]}"; do command -v "$c" >/dev/null 2>&1 || need+=("$c"); done
  [ -e /usr/include/x86_64-linux-gnu/openmpi ] || [ -e /usr/lib/x86_64-linux-gnu/openmpi/include ] \
    || command -v mpicxx >/dev/null 2>&1 || need+=(mpi-headers)
  [ ${#need[@]} -eq 0 ] && return 0
  local pkgs="libopenmpi-dev openmpi-bin cmake g++ make"
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    step "apt-get update" "Check that Debian's package mirror is reachable." apt-get update
    step "apt-get install $pkgs" "Install them by hand: apt-get install $pkgs" \
      env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $pkgs
  else
    die "missing system tools: ${need[*]}" \
      "Install Open MPI (with headers), cmake, g++ and make (Debian: apt-get install $pkgs; on a cluster: module load openmpi cmake gcc), then rerun."
  fi
}

make_venv() {
  [ -x "$VENV/bin/python" ] && return 0
  step "create virtualenv $VENV" "Install the venv module for $PY (Debian: apt-get install python3-venv)." \
    "$PY" -m venv "$VENV"
}

install_torch() {
  local have
  have=$("$VENV/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null || true)
  case "$have" in "$TORCH_VERSION"|"$TORCH_VERSION"+*) return 0;; esac
  local index=${HVDTRAIN_TORCH_INDEX:-}
  [ -z "$index" ] && [ -n "$CUDA" ] && index="https://download.pytorch.org/whl/$CUDA"
  local args=("torch==$TORCH_VERSION")
  [ -n "$index" ] && args+=(--index-url "$index")
  step "install torch $TORCH_VERSION${CUDA:+ ($CUDA)}" "Check HVDTRAIN_TORCH / HVDTRAIN_CUDA and that pip can reach the index." \
    "$VENV/bin/pip" install "${args[@]}"
}

install_python_deps() {
  step "install build and runtime dependencies" "Check that pip can reach PyPI." \
    "$VENV/bin/pip" install -r "$ROOT/requirements.txt"
}

# Cache key: everything the compiled extension depends on.
horovod_key() {
  local pyv mpiv tv
  pyv=$("$VENV/bin/python" -c 'import sys; print("py%d%d" % sys.version_info[:2])')
  tv=$("$VENV/bin/python" -c 'import torch; print(torch.__version__.replace("+", "_"))')
  mpiv=$( (mpirun --version 2>/dev/null || echo unknown) | head -1 | awk '{print $NF}')
  echo "horovod-$HOROVOD_VERSION$HOROVOD_RECIPE-$pyv-torch$tv-ompi$mpiv-${CUDA:-cpu}"
}

build_horovod_wheel() {
  local out=$1 work
  work=$(mktemp -d)
  step "download horovod $HOROVOD_VERSION sdist" "Check that pip can reach PyPI." \
    "$VENV/bin/pip" download --no-deps --no-binary :all: -d "$work" "horovod==$HOROVOD_VERSION"
  step "unpack sdist" "The download may be corrupt; remove $work and rerun." \
    tar -xzf "$work/horovod-$HOROVOD_VERSION.tar.gz" -C "$work"
  # Horovod 0.28.1 compiles its PyTorch extension (and Gloo) as C++14, but PyTorch >= 2.1 headers
  # require C++17 ("#error C++17 or later compatible compiler is required"). Upstream fixed this
  # after the release (horovod/horovod PR #3998, commit 3a31d933), which was never published.
  step "apply C++17 fix (horovod PR #3998)" "The sdist layout differs from 0.28.1." \
    sed -i -E 's/CMAKE_CXX_STANDARD 14/CMAKE_CXX_STANDARD 17/' \
    "$work/horovod-$HOROVOD_VERSION/CMakeLists.txt" "$work/horovod-$HOROVOD_VERSION/horovod/torch/CMakeLists.txt"
  if [ "$DRY" != 1 ]; then
    grep -q 'CMAKE_CXX_STANDARD 17' "$work/horovod-$HOROVOD_VERSION/horovod/torch/CMakeLists.txt" \
      || die "apply C++17 fix" "horovod/torch/CMakeLists.txt has no CMAKE_CXX_STANDARD line to patch."
  fi
  # Horovod builds everything with -mavx -mf16c where the compiler supports them, but never sets
  # the bundled Gloo's USE_AVX, so Gloo sums float16 one element at a time through software
  # conversions: an fp16 allreduce of 32 MiB took 286 ms over Gloo against 35 ms for int32 of the
  # same bytes (and 19 ms over MPI, where Horovod's own F16C sum runs). Turn Gloo's vectorised
  # fp16 path on exactly when Horovod's arch flags include AVX and F16C. USE_AVX alone is not
  # enough: it only reaches Gloo's generated config.h, which gloo/math.h does not include, so
  # Horovod's gloo_operations.cc would still instantiate the scalar template (the definition makes
  # it see Gloo's vectorised specialisation), and the bundled Gloo leaves math.cc, which holds
  # that specialisation, out of its sources.
  step "enable Gloo's AVX fp16 sum" "The sdist layout differs from 0.28.1." \
    sed -i -E 's|^    add_subdirectory\(third_party/gloo\)$|    if ("${HOROVOD_BUILD_ARCH_FLAGS}" MATCHES "-mavx" AND "${HOROVOD_BUILD_ARCH_FLAGS}" MATCHES "-mf16c")\n        set(USE_AVX ON)\n        add_definitions(-DGLOO_USE_AVX=1)\n    endif()\n&\n    if (USE_AVX)\n        target_sources(gloo PRIVATE "${PROJECT_SOURCE_DIR}/third_party/gloo/gloo/math.cc")\n    endif()|' \
    "$work/horovod-$HOROVOD_VERSION/CMakeLists.txt"
  if [ "$DRY" != 1 ]; then
    grep -q 'set(USE_AVX ON)' "$work/horovod-$HOROVOD_VERSION/CMakeLists.txt" \
      || die "enable Gloo's AVX fp16 sum" "CMakeLists.txt has no add_subdirectory(third_party/gloo) line to patch."
  fi
  local gpu_env=(HOROVOD_GPU_OPERATIONS= HOROVOD_WITHOUT_GPU=1)
  [ -n "$CUDA" ] && gpu_env=(HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_WITH_GPU=1)
  # HOROVOD_WITH_PYTORCH=1 makes a failed extension build fatal instead of silently skipped;
  # --no-build-isolation lets CMake find the torch in this venv; CMAKE_POLICY_VERSION_MINIMUM lets
  # CMake >= 4 accept the bundled gloo/flatbuffers.
  step "build horovod wheel (2-4 minutes)" "Read the compiler errors in the log; Open MPI headers, cmake and g++ are needed." \
    env HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_TENSORFLOW=1 \
    HOROVOD_WITHOUT_MXNET=1 CMAKE_POLICY_VERSION_MINIMUM=3.5 "${gpu_env[@]}" \
    MAKEFLAGS="-j$(nproc)" "$VENV/bin/pip" wheel --no-build-isolation --no-deps -w "$work/dist" \
    "$work/horovod-$HOROVOD_VERSION"
  if [ "$DRY" != 1 ]; then
    mkdir -p "$out" && cp "$work"/dist/horovod-*.whl "$out/"
  fi
  rm -rf "$work"
}

install_horovod() {
  local key dir
  if [ "$DRY" = 1 ] && ! [ -x "$VENV/bin/python" ]; then key="horovod-$HOROVOD_VERSION$HOROVOD_RECIPE-<python>-<torch>-<mpi>-${CUDA:-cpu}"
  else key=$(horovod_key); fi
  dir=$CACHE/$key
  if [ "$DRY" != 1 ] && "$VENV/bin/python" -c 'import horovod.torch' 2>/dev/null \
     && [ "$(cat "$VENV/.horovod-key" 2>/dev/null)" = "$key" ]; then
    return 0
  fi
  if ! ls "$dir"/horovod-*.whl >/dev/null 2>&1; then
    build_horovod_wheel "$dir"
  else
    say "using cached Horovod wheel $dir"
  fi
  step "install horovod wheel" "Remove $dir to force a rebuild." \
    sh -c "'$VENV/bin/pip' install --force-reinstall --no-deps '$dir'/horovod-*.whl"
  [ "$DRY" = 1 ] || echo "$key" >"$VENV/.horovod-key"
}

install_hvdtrain() {
  step "install hvdtrain (editable)" "Check setup.py." \
    "$VENV/bin/pip" install --no-deps --no-build-isolation -e "$ROOT"
}

check_build() {
  [ "$DRY" = 1 ] && { printf '[dry-run] check: horovodrun --check-build shows PyTorch, MPI, Gloo%s\n' "${CUDA:+, NCCL}"; return 0; }
  local out
  out=$("$VENV/bin/horovodrun" --check-build 2>&1) || die "horovodrun --check-build" "Horovod is broken; remove $CACHE and rerun."
  echo "$out" >>"$LOG"
  local want=("PyTorch" "MPI" "Gloo")
  [ -n "$CUDA" ] && want+=("NCCL")
  for w in "${want[@]}"; do
    echo "$out" | grep -Eq "\[X\] $w\$" || die "horovodrun --check-build: $w missing" "Remove $CACHE and rerun; the build log says why $w was skipped."
  done
}

# What the Python steps depend on; when it matches the last good run they are skipped (seconds, not a minute).
stamp() {
  cat "$ROOT/scripts/install.sh" "$ROOT/requirements.txt" "$ROOT/setup.py" | sha256sum | cut -c1-16
  echo "$TORCH_VERSION ${CUDA:-cpu} ${HVDTRAIN_TORCH_INDEX:-}"
}

main() {
  system_packages
  make_venv
  if [ "$DRY" != 1 ] && [ "$(cat "$VENV/.hvdtrain-stamp" 2>/dev/null)" = "$(stamp)" ] \
     && "$VENV/bin/python" -c 'import horovod.torch, hvdtrain' 2>/dev/null; then
    say "up to date: $VENV"
    return 0
  fi
  install_torch
  install_python_deps
  install_horovod
  install_hvdtrain
  check_build
  [ "$DRY" = 1 ] || stamp >"$VENV/.hvdtrain-stamp"
  [ "$DRY" = 1 ] || say "ready: $VENV ($(horovod_key))"
}
main "$@"
