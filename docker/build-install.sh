#!/usr/bin/env bash
# Runs scripts/install.sh inside an image build (both Dockerfiles), with the build-time-only inputs:
# PIP_CERT (a mounted CA bundle), PIP_FIND_LINKS (a mounted wheel folder) and HOROVOD_WHEEL_CACHE
# (a mounted, read-only HVDTRAIN_CACHE). None of them is copied into the image.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# An empty PIP_* variable is not "unset" to pip: an empty cert could even turn verification off.
for v in PIP_CERT PIP_FIND_LINKS; do
  [ -n "${!v:-}" ] || unset "$v"
done
if [ -n "${PIP_CERT:-}" ] && [ ! -r "$PIP_CERT" ]; then
  echo "[build] FAILED: PIP_CERT=$PIP_CERT is not mounted into the build. Add -v HOST_BUNDLE:$PIP_CERT:ro." >&2
  exit 1
fi

# install.sh writes a freshly built wheel into its cache, so a read-only mount is copied first;
# without the mount (or without a matching wheel) Horovod is compiled here. Only the Horovod wheels
# and the CUDA toolchain: a developer's cache also holds venvs and torch wheels (GBs) an image never uses.
cache=$(mktemp -d)
if [ -d "${HOROVOD_WHEEL_CACHE:-/nonexistent}" ]; then
  for kept in "$HOROVOD_WHEEL_CACHE"/horovod-* "$HOROVOD_WHEEL_CACHE"/cuda-*; do
    if [ -d "$kept" ]; then cp -r "$kept" "$cache"/; fi
  done
fi

export HVDTRAIN_VENV=/opt/hvdtrain/.venv HVDTRAIN_CACHE=$cache HVDTRAIN_LOG_DIR=/tmp/hvdtrain-install-logs \
  PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
if ! scripts/install.sh; then
  # The build container disappears with its log: show the end of it.
  tail -n 60 "$HVDTRAIN_LOG_DIR/install.log" >&2
  exit 1
fi
rm -rf "$cache" "$HVDTRAIN_LOG_DIR" /root/.cache /tmp/pip-*
