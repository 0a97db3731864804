#!/usr/bin/env bash
# sshd for multi-host horovodrun, on the port baked into /etc/ssh/sshd_config.d/hvdtrain.conf.
# Host keys are made on first start so that no two containers share them. As root it serves every
# user with keys; as a non-root user it serves only that user (keys under ~/.ssh, which may be a
# read-only mount such as the MPI Operator's Secret; its own host key and pid file live in ~/.sshd).
set -euo pipefail
if [ "$(id -u)" = 0 ]; then
  ssh-keygen -A >/dev/null
  exec /usr/sbin/sshd -D -e "$@"
fi
own=$HOME/.sshd
mkdir -p "$own" && chmod 700 "$own"
[ -f "$own/ssh_host_ed25519_key" ] || ssh-keygen -q -t ed25519 -N '' -f "$own/ssh_host_ed25519_key"
exec /usr/sbin/sshd -D -e -h "$own/ssh_host_ed25519_key" -o UsePAM=no -o PidFile="$own/sshd.pid" "$@"
