#!/usr/bin/env bash
# The user, ssh and folder layout both images share (docker/Dockerfile.cpu and .gpu run it as root
# at build time), and what the cluster launchers expect of it (docker/README.md):
# - user `hvd` (uid USER_UID, default 1000) with home /home/hvd: the Kubeflow MPI Operator mounts
#   its ssh Secret at sshAuthMountPath (/home/hvd/.ssh), read-only and root-owned;
# - sshd on SSH_PORT (2222): runnable by that user (start-sshd), password logins off, and
#   `StrictModes no`, since mounted keys do not have the owner and modes sshd's strict check wants;
# - ssh client: every host on SSH_PORT, no host-key prompt or known_hosts file (hosts are
#   replaced whenever pods or containers are);
# - no host keys in the image: start-sshd makes them when a container starts, so no two share one.
set -euo pipefail
SSH_PORT=${1:?usage: setup-image.sh SSH_PORT USER_UID}
USER_UID=${2:?usage: setup-image.sh SSH_PORT USER_UID}

printf 'Port %s\nPasswordAuthentication no\nKbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\nStrictModes no\n' \
  "$SSH_PORT" >/etc/ssh/sshd_config.d/hvdtrain.conf
printf 'Host *\n  Port %s\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n' \
  "$SSH_PORT" >/etc/ssh/ssh_config.d/hvdtrain.conf
rm -f /etc/ssh/ssh_host_*
mkdir -p /run/sshd
# Ubuntu's images come with a user "ubuntu" at uid 1000; ours takes its place.
if id ubuntu >/dev/null 2>&1; then userdel --remove ubuntu; fi
useradd --create-home --uid "$USER_UID" --shell /bin/bash hvd
mkdir -p /data /checkpoints
chown hvd:hvd /data /checkpoints
