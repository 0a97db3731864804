#!/usr/bin/env bash
# Rootful podman on a machine with no Docker engine and no registry (docker/README.md):
# the packages, a private configuration and storage folder, and a Debian bookworm base image made
# with debootstrap and tagged under the names our Dockerfiles' FROM lines use, so they build unchanged.
# Idempotent: the second run takes about a second.
#
#   scripts/container-base.sh                 set up (packages, configuration, base image)
#   scripts/container-base.sh podman ARGS...  run podman with this configuration (after set-up)
#   scripts/container-base.sh env             print the export lines of this configuration
#
# Knobs: HVDTRAIN_CONTAINERS (folder for configuration and images, default /var/tmp/hvdtrain-containers),
#        HVDTRAIN_APT_MIRROR (Debian mirror for debootstrap, default: the one this machine's apt uses).
set -euo pipefail

DIR=${HVDTRAIN_CONTAINERS:-/var/tmp/hvdtrain-containers}
BASE=localhost/debian:bookworm
# FROM lines in docker/Dockerfile.*; a local tag wins over a pull (builds run with --pull=never).
TAGS=(docker.io/library/debian:bookworm docker.io/library/debian:bookworm-slim)
PACKAGES="podman buildah debootstrap runc uidmap slirp4netns fuse-overlayfs"
LOG=$DIR/setup.log

die() { printf '[containers] FAILED: %s. %s\n' "$1" "$2" >&2; exit 1; }
say() { printf '[containers] %s\n' "$*" >&2; }

export CONTAINERS_CONF=$DIR/containers.conf
export CONTAINERS_STORAGE_CONF=$DIR/storage.conf
export CONTAINERS_REGISTRIES_CONF=$DIR/registries.conf

case "${1:-}" in
  podman) shift; exec podman "$@" ;;
  env) printf 'export %s=%q\n' CONTAINERS_CONF "$CONTAINERS_CONF" CONTAINERS_STORAGE_CONF \
         "$CONTAINERS_STORAGE_CONF" CONTAINERS_REGISTRIES_CONF "$CONTAINERS_REGISTRIES_CONF"; exit 0 ;;
  "") ;;
  *) die "unknown command '$1'" "Use no argument, 'podman ARGS...' or 'env'." ;;
esac

[ "$(id -u)" = 0 ] || die "needs root" "Rootful podman builds the images here; run as root (or build with docker where an engine exists)."
mkdir -p "$DIR"
: >"$LOG"

packages() {
  local missing=()
  for c in podman buildah debootstrap runc newuidmap slirp4netns fuse-overlayfs; do
    command -v "$c" >/dev/null 2>&1 || missing+=("$c")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  command -v apt-get >/dev/null 2>&1 || die "missing ${missing[*]}" "Install $PACKAGES with your package manager."
  say "installing $PACKAGES (about a minute)"
  { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y $PACKAGES; } >>"$LOG" 2>&1 \
    || die "apt-get install $PACKAGES" "Check that Debian's mirror is reachable; log: $LOG."
}

# Written before the first podman command: storage that records no driver makes later cleanups hang.
configure() {
  mkdir -p "$DIR/storage"
  # No CAP_SYS_RESOURCE here: the default nofile limit cannot be raised (crun/runc setrlimit EPERM).
  # crun rejects hybrid cgroups; runc works. No systemd as PID 1: cgroupfs and file events.
  cat >"$CONTAINERS_CONF.tmp" <<'EOF'
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
EOF
  # runroot on /run: it is emptied at boot, so no stale locks survive a restart.
  cat >"$CONTAINERS_STORAGE_CONF.tmp" <<EOF
[storage]
driver = "overlay"
graphroot = "$DIR/storage"
runroot = "/run/hvdtrain-containers"
EOF
  cat >"$CONTAINERS_REGISTRIES_CONF.tmp" <<'EOF'
unqualified-search-registries = ["docker.io"]
short-name-mode = "permissive"
EOF
  for f in "$CONTAINERS_CONF" "$CONTAINERS_STORAGE_CONF" "$CONTAINERS_REGISTRIES_CONF"; do
    cmp -s "$f.tmp" "$f" 2>/dev/null && rm "$f.tmp" || mv "$f.tmp" "$f"
  done
}

mirror() {
  if [ -n "${HVDTRAIN_APT_MIRROR:-}" ]; then echo "$HVDTRAIN_APT_MIRROR"; return; fi
  local m
  m=$(grep -rhoE '(https?://[^ ]+/debian)/?( |$)' /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null \
      | grep -v security | head -1 | tr -d ' ') || true
  echo "${m:-http://deb.debian.org/debian}"
}

base_image() {
  local have=1
  podman image exists "$BASE" || have=0
  if [ $have = 0 ]; then
    local url rootfs=$DIR/rootfs
    url=$(mirror)
    say "debootstrap bookworm from $url (about 30 s)"
    rm -rf "$rootfs"
    debootstrap --variant=minbase bookworm "$rootfs" "$url" >>"$LOG" 2>&1 \
      || die "debootstrap bookworm from $url" "Set HVDTRAIN_APT_MIRROR to a reachable Debian mirror; log: $LOG."
    rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/archives/*.deb
    cat >"$rootfs/etc/apt/sources.list" <<EOF
deb $url bookworm main
deb $url bookworm-updates main
deb ${url%/debian}/debian-security bookworm-security main
EOF
    tar --numeric-owner -C "$rootfs" -c . | podman import --change 'CMD ["/bin/bash"]' - "$BASE" >>"$LOG" 2>&1 \
      || die "podman import of the debootstrap tree" "Log: $LOG."
    rm -rf "$rootfs"
  fi
  for t in "${TAGS[@]}"; do podman tag "$BASE" "$t" >>"$LOG" 2>&1 || die "podman tag $t" "Log: $LOG."; done
}

packages
configure
base_image
say "ready: $BASE (tags: ${TAGS[*]}); podman via: $0 podman ..."
