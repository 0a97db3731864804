#!/usr/bin/env bash
# A multi-host cluster on one machine: N network-namespace "hosts" on a private bridge, each with its
# own address, hostname (resolving to that address) and sshd, so horovodrun launches remote ranks over
# real ssh; tc limits the links. See docs/multihost.md (topology, traps, figures).
#
#   testbed.sh up N [rate]        N hosts (rate e.g. 200mbit, 1gbit; default: unlimited); idempotent
#   testbed.sh run [-h I] CMD...  run CMD on host I (default 0) with its hostname and the testbed's ssh
#   testbed.sh goodput A B [sec]  TCP goodput from host A to host B (iperf3), one JSON line
#   testbed.sh status             hosts, addresses, sshd PIDs, rate; exit 1 when not up
#   testbed.sh down               kill the processes inside the namespaces (by PID), delete everything
#
# Knobs: HVD_TESTBED_PREFIX (default hvd: namespaces/hostnames hvd-n0.., switch hvd-sw; pick another
# for a second concurrent copy), HVD_TESTBED_NET (first three octets of the /24, default 10.213.7),
# HVD_TESTBED_DIR (state: keys, sshd configs, logs; default /run/hvdtrain-testbed/<prefix>).
#
# Safety: nothing is configured in the root namespace. Addresses exist only inside the namespaces
# made here, which have no default route and no DNS, so no packet can leave them.
set -euo pipefail

PREFIX=${HVD_TESTBED_PREFIX:-hvd}
NET=${HVD_TESTBED_NET:-10.213.7}
DIR=${HVD_TESTBED_DIR:-/run/hvdtrain-testbed/$PREFIX}
SW=$PREFIX-sw
NIC=eth0   # the same name in every host: Horovod only uses interfaces common to all hosts

say() { printf '[testbed] %s\n' "$*" >&2; }
die() { printf '[testbed] error: %s\n' "$*" >&2; exit 1; }
host() { echo "$PREFIX-n$1"; }
addr() { echo "$NET.$((10 + $1))"; }
count() { cat "$DIR/hosts" 2>/dev/null || echo 0; }
in_ns() { local ns=$1; shift; ip netns exec "$ns" "$@"; }

# Root with CAP_NET_ADMIN/CAP_SYS_ADMIN is needed (netns, bind mounts, unshare); say so in one line.
check_privileges() {
  [ "$(id -u)" = 0 ] || die "needs root (network namespaces, bind mounts, unshare)"
  ensure_packages
  local probe="$PREFIX-probe$$"
  ip netns add "$probe" 2>/dev/null || die "cannot create network namespaces (needs CAP_SYS_ADMIN and CAP_NET_ADMIN)"
  ip netns del "$probe"
}

# Debian packages the testbed needs, installed like scripts/install.sh does: via apt when root and missing.
ensure_packages() {
  local need=() cmd pkg
  for pair in ip:iproute2 tc:iproute2 /usr/sbin/sshd:openssh-server ssh:openssh-client \
              ssh-keygen:openssh-client iperf3:iperf3 unshare:util-linux; do
    cmd=${pair%%:*}; pkg=${pair#*:}
    command -v "$cmd" >/dev/null 2>&1 || [[ " ${need[*]} " == *" $pkg "* ]] || need+=("$pkg")
  done
  [ ${#need[@]} -eq 0 ] && return 0
  command -v apt-get >/dev/null 2>&1 || die "missing packages: ${need[*]} (no apt-get to install them)"
  say "installing ${need[*]}"
  apt-get update -qq >/dev/null || die "apt-get update failed"
  # policy-rc.d (Docker images) or its absence: either way the system sshd is not what we use.
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null \
    || die "apt-get install ${need[*]} failed"
}

write_keys_and_configs() {
  mkdir -p "$DIR/bin" && chmod 700 "$DIR"
  [ -f "$DIR/id_ed25519" ] || ssh-keygen -q -t ed25519 -N '' -C "testbed-$PREFIX" -f "$DIR/id_ed25519"
  [ -f "$DIR/host_ed25519" ] || ssh-keygen -q -t ed25519 -N '' -C "testbed-host-$PREFIX" -f "$DIR/host_ed25519"
  cp "$DIR/id_ed25519.pub" "$DIR/authorized_keys"
  cat >"$DIR/ssh_config" <<EOF
Host *
  User root
  IdentityFile $DIR/id_ed25519
  IdentitiesOnly yes
  UserKnownHostsFile $DIR/known_hosts
  GlobalKnownHostsFile /dev/null
  StrictHostKeyChecking accept-new
  BatchMode yes
  ConnectTimeout 5
  LogLevel ERROR
EOF
  # Trap 2: ssh ignores \$HOME for its config, so a wrapper first on PATH covers horovodrun and mpirun.
  printf '#!/bin/sh\nexec /usr/bin/ssh -F %s "$@"\n' "$DIR/ssh_config" >"$DIR/bin/ssh"
  chmod 755 "$DIR/bin/ssh"
}

write_sshd_config() {
  local i=$1
  cat >"$DIR/sshd-$i.conf" <<EOF
ListenAddress $(addr "$i")
HostKey $DIR/host_ed25519
PidFile $DIR/sshd-$i.pid
AuthorizedKeysFile $DIR/authorized_keys
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PrintMotd no
MaxStartups 100:30:200
MaxSessions 100
EOF
}

# /etc/netns/<ns>/{hosts,resolv.conf} are bind-mounted over /etc by `ip netns exec`: each hostname
# resolves to its own routable address (Gloo trap 1), and there is no DNS server to reach.
write_etc() {
  local n=$1 i ns
  for ((i = 0; i < n; i++)); do
    ns=$(host "$i")
    mkdir -p "/etc/netns/$ns"
    { echo "127.0.0.1 localhost"; for ((j = 0; j < n; j++)); do echo "$(addr "$j") $(host "$j")"; done; } \
      >"/etc/netns/$ns/hosts"
    echo "# testbed $PREFIX: no DNS" >"/etc/netns/$ns/resolv.conf"
  done
}

apply_rate() {
  local n=$1 rate=$2 i
  for ((i = 0; i < n; i++)); do
    if [ -n "$rate" ]; then
      # Egress on both ends of the veth: host->switch and switch->host are each limited.
      in_ns "$(host "$i")" tc qdisc replace dev "$NIC" root tbf rate "$rate" burst 256kb latency 50ms
      in_ns "$SW" tc qdisc replace dev "p$i" root tbf rate "$rate" burst 256kb latency 50ms
    else
      in_ns "$(host "$i")" tc qdisc del dev "$NIC" root 2>/dev/null || true
      in_ns "$SW" tc qdisc del dev "p$i" root 2>/dev/null || true
    fi
  done
  echo "$rate" >"$DIR/rate"
}

make_host() {
  local i=$1 ns
  ns=$(host "$i")
  ip netns add "$ns"
  in_ns "$ns" sysctl -qw net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1
  # Both veth ends are created directly inside their namespaces: no name ever appears in the root one.
  ip link add "$NIC" netns "$ns" type veth peer name "p$i" netns "$SW"
  in_ns "$SW" ip link set "p$i" master br0 up
  in_ns "$ns" ip addr add "$(addr "$i")/24" dev "$NIC"
  in_ns "$ns" ip link set lo up
  in_ns "$ns" ip link set "$NIC" up
  write_sshd_config "$i"
  # sshd gets its own UTS namespace with the host's name; remote ranks inherit it.
  in_ns "$ns" unshare --uts -- sh -c "hostname $ns && exec /usr/sbin/sshd -f $DIR/sshd-$i.conf -E $DIR/sshd-$i.log"
}

wait_ready() {
  local n=$1 i t
  for ((i = 0; i < n; i++)); do
    for ((t = 0; t < 50; t++)); do
      run_on 0 ssh -o ConnectTimeout=2 "$(host "$i")" true 2>/dev/null && continue 2
      sleep 0.1
    done
    die "sshd on $(host "$i") does not accept connections (log: $DIR/sshd-$i.log)"
  done
}

is_up() {
  local n i pid
  n=$(count)
  [ "$n" -gt 0 ] || return 1
  for ((i = 0; i < n; i++)); do
    pid=$(cat "$DIR/sshd-$i.pid" 2>/dev/null) || return 1
    alive "$pid" || return 1
  done
}

# Trap 7: a killed sshd can linger as a zombie; kill -0 would call it alive.
alive() { [ -r "/proc/$1/stat" ] && [ "$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" != Z ]; }

cmd_up() {
  local n=${1:-}; local rate=${2:-}
  [[ "$n" =~ ^[1-9][0-9]?$ ]] || die "usage: testbed.sh up N [rate]  (N = 1..99 hosts)"
  [ -z "$rate" ] || [[ "$rate" =~ ^[0-9]+(\.[0-9]+)?([kmg]?bit)$ ]] || die "rate must look like 200mbit or 1gbit, got '$rate'"
  check_privileges
  if [ "$(count)" = "$n" ] && is_up; then
    [ "$(cat "$DIR/rate" 2>/dev/null)" = "$rate" ] || apply_rate "$n" "$rate"
    say "up: $n hosts${rate:+ at $rate} (already)"
    return 0
  fi
  cmd_down keep >/dev/null 2>&1 || true
  trap 'say "up failed; cleaning up"; cmd_down keep >/dev/null 2>&1 || true' ERR EXIT
  write_keys_and_configs
  mkdir -p /run/sshd   # sshd's privilege-separation directory
  ip netns add "$SW"
  in_ns "$SW" sysctl -qw net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1
  in_ns "$SW" ip link add br0 type bridge
  in_ns "$SW" ip link set br0 up
  echo "$n" >"$DIR/hosts"
  write_etc "$n"
  for ((i = 0; i < n; i++)); do make_host "$i"; done
  apply_rate "$n" "$rate"
  wait_ready "$n"
  trap - ERR EXIT
  say "up: $n hosts ($(host 0)..$(host $((n - 1))), $NET.0/24)${rate:+ at $rate}"
}

# Kill every process inside our namespaces (sshd, ranks left behind by a failed Gloo job: trap 4),
# by PID: all namespace hosts share one PID space, so names would hit other people's processes.
kill_ns_processes() {
  local ns=$1 sig pids t
  for sig in TERM KILL; do
    pids=$(ip netns pids "$ns" 2>/dev/null || true)
    [ -z "$pids" ] && return 0
    kill -"$sig" $pids 2>/dev/null || true
    for ((t = 0; t < 20; t++)); do
      pids=$(ip netns pids "$ns" 2>/dev/null || true)
      [ -z "$pids" ] && return 0
      sleep 0.1
    done
  done
}

cmd_down() {
  local ns
  [ "$(id -u)" = 0 ] || die "needs root"
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^$PREFIX-(n[0-9]+|sw)$" || true); do
    kill_ns_processes "$ns"
    ip netns del "$ns" 2>/dev/null || true
    rm -rf "/etc/netns/$ns"
  done
  rm -f "$DIR"/sshd-*.pid "$DIR/hosts" "$DIR/rate" "$DIR/known_hosts"
  # A failed `up` keeps keys and logs for its error message; `down` removes only files it made.
  if [ "${1:-}" != keep ]; then
    rm -f "$DIR"/{id_ed25519,id_ed25519.pub,host_ed25519,host_ed25519.pub,authorized_keys,ssh_config} \
      "$DIR"/sshd-*.conf "$DIR"/sshd-*.log "$DIR"/iperf3-*.log "$DIR/bin/ssh"
    rmdir "$DIR/bin" "$DIR" 2>/dev/null || true
  fi
  say "down: $PREFIX"
}

# run_on I CMD...: CMD on host I, in a fresh UTS namespace named like the host, with the ssh wrapper.
run_on() {
  local i=$1; shift
  local ns; ns=$(host "$i")
  ip netns exec "$ns" unshare --uts -- sh -c \
    'hostname "$0" && PATH="$1:$PATH" && export PATH HVD_TESTBED_PREFIX && shift && exec "$@"' \
    "$ns" "$DIR/bin" "$@"
}

cmd_run() {
  local i=0
  if [ "${1:-}" = -h ]; then i=$2; shift 2; fi
  [ $# -gt 0 ] || die "usage: testbed.sh run [-h I] CMD..."
  is_up || die "testbed $PREFIX is not up (testbed.sh up N)"
  [ "$i" -lt "$(count)" ] || die "no host $i (hosts 0..$(($(count) - 1)))"
  export HVD_TESTBED_PREFIX=$PREFIX
  run_on "$i" "$@"
}

cmd_status() {
  local n i pid
  if ! is_up; then echo "testbed $PREFIX: down"; return 1; fi
  n=$(count)
  local rate; rate=$(cat "$DIR/rate" 2>/dev/null || true)
  echo "testbed $PREFIX: $n hosts, link ${rate:-unlimited}, state $DIR"
  for ((i = 0; i < n; i++)); do
    pid=$(cat "$DIR/sshd-$i.pid")
    echo "  $(host "$i")  $(addr "$i")  sshd pid $pid  netns inode $(stat -L -c %i "/run/netns/$(host "$i")")"
  done
}

cmd_goodput() {
  local a=${1:-} b=${2:-} secs=${3:-3} n out port
  n=$(count)
  [[ "$a" =~ ^[0-9]+$ && "$b" =~ ^[0-9]+$ && "$a" != "$b" ]] || die "usage: testbed.sh goodput A B [seconds]  (host numbers)"
  is_up || die "testbed $PREFIX is not up (testbed.sh up N)"
  [ "$a" -lt "$n" ] && [ "$b" -lt "$n" ] || die "hosts are 0..$((n - 1))"
  port=$((5201 + a))   # one port per sender: A->B and C->B can be measured at the same time
  # A one-off server on B's address, our own child (waited for, so no zombie is left: trap 7).
  in_ns "$(host "$b")" iperf3 -s -1 -B "$(addr "$b")" -p "$port" --logfile "$DIR/iperf3-$a-$b.log" &
  local pid=$! t
  for ((t = 0; t < 50; t++)); do
    in_ns "$(host "$b")" ss -Hltn "sport = :$port" | grep -q . && break
    sleep 0.1
  done
  # iperf3 3.12 exits 0 even when it cannot connect: the JSON's "error" field is checked below.
  out=$(in_ns "$(host "$a")" iperf3 -c "$(addr "$b")" -p "$port" -t "$secs" -J 2>/dev/null || true)
  if alive "$pid"; then kill "$pid" 2>/dev/null || true; fi
  wait "$pid" 2>/dev/null || true
  [ -n "$out" ] || die "iperf3 from $(host "$a") to $(host "$b") failed (log: $DIR/iperf3-$a-$b.log)"
  HOST_A=$(host "$a") HOST_B=$(host "$b") RATE=$(cat "$DIR/rate") python3 -c '
import json, os, sys
r = json.load(sys.stdin)
if "error" in r: sys.exit("[testbed] error: iperf3: " + r["error"])
end = r["end"]
print(json.dumps({"metric": "tcp_goodput", "from": os.environ["HOST_A"], "to": os.environ["HOST_B"],
    "link": os.environ["RATE"] or "unlimited", "seconds": round(end["sum_received"]["seconds"], 2),
    "goodput_mbit_s": round(end["sum_received"]["bits_per_second"] / 1e6, 1),
    "retransmits": end["sum_sent"].get("retransmits")}))' <<<"$out"
}

main() {
  local cmd=${1:-}; shift || true
  case "$cmd" in
    up) cmd_up "$@" ;;
    down) cmd_down ;;
    run) cmd_run "$@" ;;
    status) cmd_status ;;
    goodput) cmd_goodput "$@" ;;
    *) die "usage: testbed.sh up N [rate] | run [-h I] CMD... | goodput A B [sec] | status | down" ;;
  esac
}
main "$@"
