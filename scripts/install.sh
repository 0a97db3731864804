#!/usr/bin/env bash
# Idempotent set-up of hvdtrain: system packages, .venv, PyTorch, Horovod (built once, cached), hvdtrain.
# Sourced-or-run by demo.sh and test.sh. `install.sh horovod`: only Horovod, into HVDTRAIN_PYTHON's own
# environment (what `hvdtrain build-horovod` runs after `pip install .`). Knobs (environment):
#   HVDTRAIN_PYTHON        interpreter for the venv (default: python3)
#   HVDTRAIN_VENV          venv folder (default: <checkout>/.venv)
#   HVDTRAIN_TORCH         torch version (default: 2.13.0)
#   HVDTRAIN_CUDA          "" for CPU (default), or a CUDA tag: builds Horovod with NCCL GPU operations.
#                          cu130: everything from PyPI alone (PyPI's torch is the CUDA 13.0 build; the
#                          CUDA 13.0 toolchain from NVIDIA's wheels is assembled into a CUDA home in the
#                          cache; NCCL is torch's own nvidia-nccl-cu13). Other tags (cu126, cu128...):
#                          torch from PyTorch's index for that tag, and a CUDA toolkit of the machine
#                          (HOROVOD_CUDA_HOME, default /usr/local/cuda; PyPI has no CUDA 12 nvcc)
#   HVDTRAIN_TORCH_INDEX   explicit pip index URL for torch (overrides the one HVDTRAIN_CUDA selects)
#   HVDTRAIN_WITHOUT_MPI=1 build Horovod with Gloo only (hosts without Open MPI; no mpirun needed)
#   HOROVOD_CUDA_HOME, HOROVOD_NCCL_HOME, HOROVOD_BUILD_CUDA_CC_LIST: passed to Horovod's build
#   HVDTRAIN_CACHE         wheel cache (default: ${XDG_CACHE_HOME:-~/.cache}/hvdtrain)
#   HVDTRAIN_DRY_RUN=1     print the steps that would run, change nothing
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)  # this script's folder (the package's, when shipped)
ROOT=$(cd "$HERE/.." && pwd)
PY=${HVDTRAIN_PYTHON:-python3}
VENV=${HVDTRAIN_VENV:-$ROOT/.venv}
# The interpreter and pip the steps use: the venv's (`install.sh wheel` uses HVDTRAIN_PYTHON's own).
VPY=$VENV/bin/python
VPIP=("$VENV/bin/pip")
TORCH_VERSION=${HVDTRAIN_TORCH:-2.13.0}
CUDA=${HVDTRAIN_CUDA:-}
NO_MPI=${HVDTRAIN_WITHOUT_MPI:-0}
# CUDA 13.0 from PyPI alone: NVIDIA's toolchain wheels unpack into one CUDA home, nvidia/cu13/{bin,
# include,lib,nvvm} (nvcc, ptxas, cicc, cudart with its static library, CCCL, the crt headers).
CUDA13_WHEELS=(nvidia-cuda-nvcc==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85
               nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88)
# CUDA 13 builds for Turing (7.5) and newer, the architectures CUDA 13 still supports.
CUDA13_CC_LIST=75,80,86,89,90,100,120
HOROVOD_VERSION=0.28.1
# Bump when the patches applied to the sdist change, so a cached wheel built without them is not reused.
HOROVOD_RECIPE=r6
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
  local need=() cmds=(cmake g++ make) pkgs="cmake g++ make"
  [ "$NO_MPI" = 1 ] || { cmds+=(mpirun); pkgs="libopenmpi-dev openmpi-bin $pkgs"; }
  for c in "${cmds[@]}"; do command -v "$c" >/dev/null 2>&1 || need+=("$c"); done
  [ "$NO_MPI" = 1 ] || [ -e /usr/include/x86_64-linux-gnu/openmpi ] || [ -e /usr/lib/x86_64-linux-gnu/openmpi/include ] \
    || command -v mpicxx >/dev/null 2>&1 || need+=(mpi-headers)
  [ ${#need[@]} -eq 0 ] && return 0
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

# The CUDA version a tag names: cu130 -> 13.0, cu126 -> 12.6.
cuda_version() { local d=${1#cu}; echo "${d:0:${#d}-1}.${d: -1}"; }

torch_index() {
  if [ -n "${HVDTRAIN_TORCH_INDEX:-}" ]; then echo "$HVDTRAIN_TORCH_INDEX"
  elif [ -n "$CUDA" ] && [ "$CUDA" != cu130 ]; then echo "https://download.pytorch.org/whl/$CUDA"
  fi  # CPU, and cu130: pip's own indexes (PyPI's Linux torch is the CUDA 13.0 build)
}

# The wheels for this torch, resolved once and kept: a Python with no CPU torch at hand gets PyPI's
# CUDA build (torch, triton, cuDNN, NCCL: 1.3 GB over the network), and without this every clean
# checkout (CI's) downloads them again. The wheels pip fetched over the network are kept in the cache
# folder; files already on this machine are named where they lie. pip prefers an index's copy to a
# --find-links one, so the install names the resolved files themselves. Prints the folder.
keep_torch_wheels() {
  local dir urls
  dir=$CACHE/wheels/torch-$TORCH_VERSION-$("$VPY" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')-${CUDA:-cpu}
  # A list naming a file that is gone (a copied cache, a cleaned wheel folder) is resolved again.
  if [ -f "$dir/wheels.txt" ] && ! "$VPY" -c 'import os, sys; sys.exit(not all(map(os.path.exists, open(sys.argv[1]).read().splitlines())))' "$dir/wheels.txt"; then
    rm -f "$dir/wheels.txt"
  fi
  if ! [ -f "$dir/wheels.txt" ]; then
    mkdir -p "$dir"
    step "resolve torch $TORCH_VERSION" "Check HVDTRAIN_TORCH / HVDTRAIN_CUDA and that pip can reach the index." \
      "$VENV/bin/pip" install --dry-run --ignore-installed --quiet --report "$dir/report.json" "$@" >&2
    urls=$("$VPY" -c 'import json, sys
for item in json.load(open(sys.argv[1]))["install"]:
    url = item["download_info"]["url"].split("#")[0]
    if url.startswith(("http://", "https://")): print(url)' "$dir/report.json")
    if [ -n "$urls" ]; then
      # shellcheck disable=SC2086  # one URL per word
      step "keep torch's downloaded wheels in $dir" "Check that pip can reach the index and that $CACHE has room." \
        "$VENV/bin/pip" download --no-deps --quiet --dest "$dir" $urls >&2
    fi
    "$VPY" -c 'import json, os, sys, urllib.parse
for item in json.load(open(sys.argv[1]))["install"]:
    url = urllib.parse.urlsplit(item["download_info"]["url"])
    name = urllib.parse.unquote(url.path)
    print(name if url.scheme == "file" else os.path.join(sys.argv[2], os.path.basename(name)))' \
      "$dir/report.json" "$dir" >"$dir/wheels.tmp"
    mv "$dir/wheels.tmp" "$dir/wheels.txt"
  fi
  echo "$dir"
}

install_torch() {
  local have want=none
  [ -n "$CUDA" ] && want=$(cuda_version "$CUDA")
  have=$("$VPY" -c 'import torch; print(torch.__version__, torch.version.cuda or "none")' 2>/dev/null || true)
  case "$have" in "$TORCH_VERSION $want"|"$TORCH_VERSION"+*" $want") return 0;; esac
  # A CPU build of Horovod against PyPI's CUDA torch: for Pythons without a CPU torch at hand (PyPI's
  # Linux torch is the CUDA build); it trains on CPU all the same.
  [ -z "$CUDA" ] && case "$have" in "$TORCH_VERSION"+*|"$TORCH_VERSION "*) return 0;; esac
  local index args=("torch==$TORCH_VERSION") kept
  index=$(torch_index)
  [ -n "$index" ] && args+=(--index-url "$index")
  if [ "$DRY" = 1 ]; then
    step "install torch $TORCH_VERSION${CUDA:+ ($CUDA)}" "" "$VENV/bin/pip" install "${args[@]}"
  else
    kept=$(keep_torch_wheels "${args[@]}")
    # The resolved set, complete: --no-deps keeps pip from asking the indexes again.
    mapfile -t args <"$kept/wheels.txt"
    step "install torch $TORCH_VERSION${CUDA:+ ($CUDA)}" "Remove $kept and rerun; check that pip can reach the index." \
      "$VENV/bin/pip" install --no-deps "${args[@]}"
  fi
  [ "$DRY" = 1 ] && return 0
  have=$("$VPY" -c 'import torch; print(torch.__version__, torch.version.cuda or "none")')
  case "$have" in
    *" $want") ;;
    *) [ -z "$CUDA" ] && { say "torch $have: a CUDA build (no CPU one for this Python); Horovod is built for CPU"; return 0; }
       die "torch $have was installed, not a build for CUDA $want" \
         "Set HVDTRAIN_TORCH_INDEX to an index with a CUDA $want build (https://download.pytorch.org/whl/$CUDA), or remove a local CPU wheel from pip's find-links (pip config list).";;
  esac
}

# The CUDA home Horovod's kernels are compiled with. cu130 without HOROVOD_CUDA_HOME: NVIDIA's
# toolchain wheels from PyPI, unpacked once into the cache; nvcc's profile looks for headers and
# libraries under targets/x86_64-linux and FindCUDAToolkit for an unversioned libcudart.so, which
# the wheels lay out differently, so a few links complete the tree.
cuda_home() {
  if [ -n "${HOROVOD_CUDA_HOME:-}" ]; then echo "$HOROVOD_CUDA_HOME"
  elif [ "$CUDA" = cu130 ]; then echo "$CACHE/cuda-13.0/nvidia/cu13"
  else echo /usr/local/cuda
  fi
}

install_cuda_toolchain() {
  [ -n "$CUDA" ] || return 0
  local home
  home=$(cuda_home)
  if [ -n "${HOROVOD_CUDA_HOME:-}" ] || [ "$CUDA" != cu130 ]; then
    [ "$DRY" = 1 ] || [ -x "$home/bin/nvcc" ] || die "no CUDA toolkit at $home (HVDTRAIN_CUDA=$CUDA)" \
      "Set HOROVOD_CUDA_HOME to a CUDA $(cuda_version "$CUDA") toolkit, or use HVDTRAIN_CUDA=cu130, whose toolchain comes from PyPI."
    return 0
  fi
  [ "$DRY" != 1 ] && [ -x "$home/bin/nvcc" ] && return 0
  step "CUDA 13.0 toolchain from PyPI into $CACHE/cuda-13.0" "Check that pip can reach PyPI (nvidia-cuda-nvcc)." \
    "${VPIP[@]}" install --no-deps --target "$CACHE/cuda-13.0" "${CUDA13_WHEELS[@]}"
  [ "$DRY" = 1 ] && return 0
  mkdir -p "$home/targets/x86_64-linux"
  ln -sfn ../../include "$home/targets/x86_64-linux/include"
  ln -sfn ../../lib "$home/targets/x86_64-linux/lib"
  ln -sfn ../../lib "$home/targets/x86_64-linux/lib64"
  ln -sfn lib "$home/lib64"
  ln -sfn libcudart.so.13 "$home/lib/libcudart.so"
  "$home/bin/nvcc" --version >>"$LOG" 2>&1 || die "the CUDA toolchain in $CACHE/cuda-13.0 does not run" "Remove that folder and rerun."
}

# Horovod's build environment for NCCL GPU operations: the CUDA home above and an NCCL. cu130 uses
# torch's own NCCL (the nvidia-nccl-cu13 wheel torch depends on, so both load one libnccl.so.2),
# linked as a shared library through a folder holding the unversioned name CMake looks for.
gpu_build_env() {
  local home nccl
  home=$(cuda_home)
  # CUDA_HOME: torch's cpp_extension, which Horovod's CMake asks for the CUDA library folders
  # (cudart), looks there (else /usr/local/cuda).
  GPU_ENV=(HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_WITH_GPU=1 "HOROVOD_CUDA_HOME=$home" "CUDA_HOME=$home")
  [ "$CUDA" = cu130 ] && GPU_ENV+=("HOROVOD_BUILD_CUDA_CC_LIST=${HOROVOD_BUILD_CUDA_CC_LIST:-$CUDA13_CC_LIST}")
  if [ -n "${HOROVOD_NCCL_HOME:-}" ] || [ "$CUDA" != cu130 ]; then return 0; fi
  if [ "$DRY" = 1 ]; then nccl="<venv>/nvidia/nccl"
  else nccl=$("$VPY" -c 'import nvidia.nccl as n; print(list(n.__path__)[0])' 2>/dev/null) \
    || die "torch's NCCL (nvidia-nccl-cu13) is not in $VENV" "Reinstall torch with HVDTRAIN_CUDA=cu130."
  fi
  GPU_ENV+=("HOROVOD_NCCL_INCLUDE=$nccl/include" "HOROVOD_NCCL_LIB=$1" HOROVOD_NCCL_LINK=SHARED)
  [ "$DRY" = 1 ] || ln -sfn "$nccl/lib/libnccl.so.2" "$1/libnccl.so"
}

install_python_deps() {
  step "install build and runtime dependencies" "Check that pip can reach PyPI." \
    "$VENV/bin/pip" install -r "$ROOT/requirements.txt"
}

# Cache key: everything the compiled extension depends on.
horovod_key() {
  local pyv mpiv tv
  pyv=$("$VPY" -c 'import sys; print("py%d%d" % sys.version_info[:2])')
  tv=$("$VPY" -c 'import torch; print(torch.__version__.replace("+", "_"))')
  mpiv=$( (mpirun --version 2>/dev/null || echo unknown) | head -1 | awk '{print "ompi" $NF}')
  [ "$NO_MPI" = 1 ] && mpiv=nompi
  # An explicit architecture list (e.g. 90 alone for one kind of GPU) builds fewer kernels: its own key.
  local cc=${HOROVOD_BUILD_CUDA_CC_LIST:+-sm${HOROVOD_BUILD_CUDA_CC_LIST//,/_}}
  echo "horovod-$HOROVOD_VERSION$HOROVOD_RECIPE-$pyv-torch$tv-$mpiv-${CUDA:-cpu}${CUDA:+$cc}"
}

build_horovod_wheel() {
  local out=$1 work
  work=$(mktemp -d)
  if [ -n "${HVDTRAIN_HOROVOD_SDIST:-}" ]; then  # a carried copy, where no index is reachable
    step "copy horovod $HOROVOD_VERSION sdist" "HVDTRAIN_HOROVOD_SDIST must name horovod-$HOROVOD_VERSION.tar.gz." \
      cp "$HVDTRAIN_HOROVOD_SDIST" "$work/horovod-$HOROVOD_VERSION.tar.gz"
  else
    step "download horovod $HOROVOD_VERSION sdist" "Check that pip can reach PyPI." \
      "${VPIP[@]}" download --no-deps --no-binary :all: -d "$work" "horovod==$HOROVOD_VERSION"
  fi
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
  # Gloo's TCP pair sets SO_SNDBUF to the size of the first message an old-style algorithm sends
  # and only ever raises it, which switches off Linux's send-buffer autotuning for that socket.
  # Horovod's Gloo reduce-scatter is such an algorithm: after one of a small tensor (ZeRO-2 and 3
  # send them), every later allreduce of 0.6 MB over that pair took ~200 ms instead of ~3 ms, and
  # the 2-rank Gloo test suite ran 4x slower. Start from the socket's own (autotuned) size instead,
  # so a small first message never shrinks it.
  step "keep Gloo's TCP send buffer autotuned" "The sdist layout differs from 0.28.1." \
    sed -i -E 's|^  size_t size = std::min\(op.preamble.nbytes, kMaxSendBufferSize\);$|&\n  if (sendBufferSize_ == 0) {\n    int current = 0;\n    socklen_t currentLen = sizeof(current);\n    if (getsockopt(fd_, SOL_SOCKET, SO_SNDBUF, \&current, \&currentLen) == 0 \&\& current > 0) {\n      sendBufferSize_ = current;\n    }\n  }|' \
    "$work/horovod-$HOROVOD_VERSION/third_party/gloo/gloo/transport/tcp/pair.cc"
  if [ "$DRY" != 1 ]; then
    grep -q 'int current = 0;' "$work/horovod-$HOROVOD_VERSION/third_party/gloo/gloo/transport/tcp/pair.cc" \
      || die "keep Gloo's TCP send buffer autotuned" "gloo/transport/tcp/pair.cc has no send-buffer sizing line to patch."
  fi
  # The background thread sleeps while every worker is idle instead of coordinating every 1 ms
  # (8-14% of a core per idle rank over Gloo; the patch file says how).
  step "let Horovod's background thread sleep while idle" "The sdist layout differs from 0.28.1." \
    patch -p1 --forward -d "$work/horovod-$HOROVOD_VERSION" -i "$HERE/horovod-idle-sleep.patch"
  # hvd.synchronize sleeps until its collective is done instead of yielding in a loop (a whole core
  # per waiting rank for as long as the collective takes; the patch file says how).
  step "let synchronize sleep until its collective is done" "The sdist layout differs from 0.28.1." \
    patch -p1 --forward -d "$work/horovod-$HOROVOD_VERSION" -i "$HERE/horovod-wait-handle.patch"
  local gpu_env=(HOROVOD_GPU_OPERATIONS= HOROVOD_WITHOUT_GPU=1) mpi=HOROVOD_WITH_MPI=1 home
  if [ -n "$CUDA" ]; then
    mkdir -p "$work/nccl-link"
    gpu_build_env "$work/nccl-link"
    gpu_env=("${GPU_ENV[@]}")
  elif [ "$DRY" != 1 ] && [ "$("$VPY" -c 'import torch; print(torch.version.cuda or "")')" = 13.0 ]; then
    # CPU operations against a CUDA torch (PyPI's only Linux build for most Pythons): Horovod's
    # extension still links the CUDA runtime whenever torch has one, so it needs a CUDA home to
    # find cudart in: the CUDA 13.0 wheels' (no NCCL, no kernels; the build time of a CPU build).
    home=$(CUDA=cu130 cuda_home)
    CUDA=cu130 install_cuda_toolchain
    gpu_env+=("HOROVOD_CUDA_HOME=$home" "CUDA_HOME=$home" "CUDAToolkit_ROOT=$home")
  fi
  [ "$NO_MPI" = 1 ] && mpi=HOROVOD_WITHOUT_MPI=1
  # HOROVOD_WITH_PYTORCH=1 makes a failed extension build fatal instead of silently skipped;
  # --no-build-isolation lets CMake find the torch in this venv; CMAKE_POLICY_VERSION_MINIMUM lets
  # CMake >= 4 accept the bundled gloo/flatbuffers.
  step "build horovod wheel (2-4 minutes)" "Read the compiler errors in the log; Open MPI headers, cmake and g++ are needed." \
    env HOROVOD_WITH_PYTORCH=1 "$mpi" HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_TENSORFLOW=1 \
    HOROVOD_WITHOUT_MXNET=1 CMAKE_POLICY_VERSION_MINIMUM=3.5 "${gpu_env[@]}" \
    MAKEFLAGS="-j$(nproc)" "${VPIP[@]}" wheel --no-build-isolation --no-deps -w "$work/dist" \
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
  if [ "$DRY" != 1 ] && "$VPY" -c 'import horovod.torch' 2>/dev/null \
     && [ "$(cat "$VENV/.horovod-key" 2>/dev/null)" = "$key" ]; then
    return 0
  fi
  if ! ls "$dir"/horovod-*.whl >/dev/null 2>&1; then
    build_horovod_wheel "$dir"
  else
    say "using cached Horovod wheel $dir"
  fi
  step "install horovod wheel" "Remove $dir to force a rebuild." \
    sh -c "'$VPY' -m pip install --force-reinstall --no-deps '$dir'/horovod-*.whl"
  [ "$DRY" = 1 ] || echo "$key" >"$VENV/.horovod-key"
}

install_hvdtrain() {
  step "install hvdtrain (editable)" "Check setup.py." \
    "$VENV/bin/pip" install --no-deps --no-build-isolation -e "$ROOT"
}

check_build() {
  [ "$DRY" = 1 ] && { printf '[dry-run] check: horovodrun --check-build shows PyTorch%s, Gloo%s\n' \
    "$([ "$NO_MPI" = 1 ] || echo ', MPI')" "${CUDA:+, NCCL}"; return 0; }
  local out
  out=$("$VENV/bin/horovodrun" --check-build 2>&1) || die "horovodrun --check-build" "Horovod is broken; remove $CACHE and rerun."
  echo "$out" >>"$LOG"
  local want=("PyTorch" "Gloo")
  [ "$NO_MPI" = 1 ] || want+=("MPI")
  [ -z "$CUDA" ] || want+=("NCCL")
  for w in "${want[@]}"; do
    echo "$out" | grep -Eq "\[X\] $w\$" || die "horovodrun --check-build: $w missing" "Remove $CACHE and rerun; the build log says why $w was skipped."
  done
}

# What the Python steps depend on; when it matches the last good run they are skipped (seconds, not a minute).
stamp() {
  cat "$ROOT/scripts/install.sh" "$ROOT/requirements.txt" "$ROOT/setup.py" | sha256sum | cut -c1-16
  echo "$TORCH_VERSION ${CUDA:-cpu} ${HVDTRAIN_TORCH_INDEX:-} mpi:$NO_MPI"
}

# install.sh wheel OUTDIR: only Horovod's wheel, built with HVDTRAIN_PYTHON's own packages (torch
# already installed there; no venv, no downloads but the sdist unless HVDTRAIN_HOROVOD_SDIST names one).
# scripts/gpu_check.sh uses it on a GPU machine whose versions differ from the carried wheel's.
wheel_only() {
  local out=${1:?usage: install.sh wheel OUTDIR}
  VPY=$PY
  VPIP=("$PY" -m pip)
  "$VPY" -c 'import torch' 2>/dev/null || die "$PY cannot import torch" "Set HVDTRAIN_PYTHON to the interpreter with torch."
  build_horovod_wheel "$out"
  say "built $(ls "$out"/horovod-*.whl 2>/dev/null | head -1)"
}

# install.sh horovod: Horovod (built once per torch, cached) into HVDTRAIN_PYTHON's own environment,
# a venv or conda env that already has torch and hvdtrain (`pip install .`); `hvdtrain build-horovod`.
horovod_only() {
  VENV=$("$PY" -c 'import sys; print(sys.prefix)')
  VPY=$PY
  VPIP=("$PY" -m pip)
  "$VPY" -c 'import torch' 2>/dev/null || die "$PY cannot import torch" "Install torch first (pip install torch), then rerun."
  system_packages
  step "install Horovod's build and runtime dependencies" "Check that pip can reach PyPI." \
    "${VPIP[@]}" install "packaging>=23" "cffi>=1.15" "cloudpickle>=2.2" "psutil>=5.9" "pyyaml>=6.0" \
    "setuptools>=68,<81" "wheel>=0.41"
  install_cuda_toolchain
  install_horovod
  check_build
  say "ready: Horovod $HOROVOD_VERSION in $VENV ($(horovod_key))"
}

main() {
  if [ "${1:-}" = wheel ]; then shift; wheel_only "$@"; return; fi
  if [ "${1:-}" = horovod ]; then horovod_only; return; fi
  system_packages
  make_venv
  if [ "$DRY" != 1 ] && [ "$(cat "$VENV/.hvdtrain-stamp" 2>/dev/null)" = "$(stamp)" ] \
     && "$VENV/bin/python" -c 'import horovod.torch, hvdtrain' 2>/dev/null; then
    say "up to date: $VENV"
    return 0
  fi
  install_torch
  install_python_deps
  install_cuda_toolchain
  install_horovod
  install_hvdtrain
  check_build
  [ "$DRY" = 1 ] || stamp >"$VENV/.hvdtrain-stamp"
  [ "$DRY" = 1 ] || say "ready: $VENV ($(horovod_key))"
}
main "$@"
