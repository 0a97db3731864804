#!/usr/bin/env bash
# sshd for multi-host horovodrun, on the port baked into /etc/ssh/sshd_config.d/hvdtrain.conf.
# Host keys are made on first start so that no two containers share them. As root it serves every
# user with keys; as a non-root user it serves only that user (keys under ~/.ssh, no privilege separation).
set -euo pipefail
if [ "$(id -u)" = 0 ]; then
  ssh-keygen -A >/dev/null
  exec /usr/sbin/sshd -D -e "$@"
fi
key=$HOME/.ssh/ssh_host_ed25519_key
mkdir -p "$HOME/.ssh" && chmod 700 "$HOME/.ssh"
[ -f "$key" ] || ssh-keygen -q -t ed25519 -N '' -f "$key"
exec /usr/sbin/sshd -D -e -h "$key" -o UsePAM=no -o PidFile="$HOME/.ssh/sshd.pid" "$@"
