"""`hvdtrain launch`: start horovodrun across hosts from a login node or inside a Slurm job.

The host list comes from `--hosts`, a `--hostfile`, or Slurm's environment (compressed node lists
such as `node[01-03,07]`, task counts such as `2(x3),1`). Before anything starts, a preflight check
asks every host over ssh for what a multi-host job needs (same Python, torch, Horovod and hvdtrain
path, the working directory, the network interface, a routable hostname) and prints one line per
problem naming the host: a mismatch found here is a clear error instead of a hang at rendezvous.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hvdtrain.errors import HvdtrainError
from hvdtrain.tools.hosts import (
    Host,
    LaunchError,
    discover_hosts,
    hosts_from_slurm,
    last_line,
    parse_hosts,
    read_hostfile,
)

# Open MPI's default (tuned) allreduce at 3 ranks measured ~2.7x slower than ring on a limited link
# (docs/multihost.md); algorithm 4 is ring. horovodrun already passes `-mca btl ...`: passing btl
# again is rejected, so only coll_tuned settings go here.
MPI_RING_ARGS = "--mca coll_tuned_use_dynamic_rules 1 --mca coll_tuned_allreduce_algorithm 4"
SSH_TIMEOUT_S = 10


class PreflightError(HvdtrainError):
    """A host that cannot run the job; the lines printed before it name each problem."""


def elastic_options(args: argparse.Namespace, slots: int) -> list[str]:
    """horovodrun's elastic flags (empty for a fixed-size job)."""
    if not args.host_discovery_script:
        if args.min_np or args.max_np or args.elastic_timeout is not None:
            raise LaunchError("--min-np/--max-np/--elastic-timeout need --host-discovery-script (elastic mode)")
        return []
    if args.controller != "gloo":
        raise LaunchError("elastic training runs on Gloo only; drop --controller mpi")
    low, high = args.min_np or 1, args.max_np or slots
    if low > high:
        raise LaunchError(f"--min-np {low} is more than --max-np {high}")
    opts = ["--min-np", str(low), "--max-np", str(high), "--host-discovery-script", args.host_discovery_script]
    if args.blacklist_cooldown:
        opts += ["--blacklist-cooldown-range", *map(str, args.blacklist_cooldown)]
    if args.elastic_timeout is not None:
        opts += ["--elastic-timeout", str(args.elastic_timeout)]
    return opts


def resolve_hosts(args: argparse.Namespace, env: Mapping[str, str]) -> list[Host]:
    if sum(map(bool, (args.hosts, args.hostfile, args.host_discovery_script))) > 1:
        raise LaunchError("pass one of --hosts, --hostfile or --host-discovery-script")
    if args.host_discovery_script:
        hosts = discover_hosts(args.host_discovery_script)
    else:
        slurm = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if args.hosts:
            hosts = parse_hosts(args.hosts)
        elif args.hostfile:
            hosts = read_hostfile(args.hostfile)
        elif args.np and not slurm:
            hosts = [Host("localhost", args.np)]  # -np alone: this machine, as horovodrun does
        else:
            hosts = hosts_from_slurm(env)
    seen = [h.name for h in hosts]
    dup = sorted({n for n in seen if seen.count(n) > 1})
    if dup:
        raise LaunchError(f"host listed twice: {', '.join(dup)}")
    return hosts


def build_command(args: argparse.Namespace, hosts: list[Host]) -> list[str]:
    """horovodrun's argument list for these hosts and options."""
    total = sum(h.slots for h in hosts)
    elastic = elastic_options(args, total)
    np = args.np or (min(total, args.max_np) if args.max_np else total)
    if np > total:
        raise LaunchError(f"-np {np} is more than the {total} slots of {len(hosts)} host(s)")
    # The horovodrun of this interpreter first (a venv's bin need not be on PATH).
    beside = Path(sys.executable).with_name("horovodrun")
    horovodrun = str(beside) if beside.exists() else shutil.which("horovodrun")
    if horovodrun is None:
        raise LaunchError(f"horovodrun not found next to {sys.executable} or on PATH; install Horovod "
                          "(./scripts/install.sh) or activate the environment that has it")
    where = elastic or ["-H", ",".join(f"{h.name}:{h.slots}" for h in hosts)]
    cmd = [horovodrun, "-np", str(np), *where, f"--{args.controller}"]
    if args.network_interface:
        cmd += ["--network-interface", args.network_interface]
    if args.ssh_port:
        cmd += ["-p", str(args.ssh_port)]
    mpi_args = " ".join(a for a in ((MPI_RING_ARGS if args.mpi_allreduce == "ring" else ""), args.mpi_args) if a)
    if re.search(r"(^|\s)--?mca\s+btl\s", args.mpi_args or ""):
        raise LaunchError("--mpi-args must not set 'btl': horovodrun already passes -mca btl "
                          "(Open MPI rejects it twice)")
    if args.controller == "mpi" and mpi_args:
        cmd.append(f"--mpi-args={mpi_args}")
    command = list(args.program)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise LaunchError("no command to launch: hvdtrain launch [options] -- COMMAND ...")
    return cmd + command


# Runs on every host with the launcher's interpreter path; prints one JSON object. Versions come
# from package metadata so nothing heavy (torch, the Horovod extension) is imported.
_PROBE = r"""
import importlib.metadata as md, importlib.util as iu, json, os, socket, sys
def v(p):
    try: return md.version(p)
    except Exception: return None
name = socket.gethostname()
try: ip = socket.gethostbyname(name)
except OSError: ip = None
spec = iu.find_spec("hvdtrain")
nic = sys.argv[2]
try:
    from hvdtrain.tools import doctor
    gpu = doctor.facts()
except Exception as e:
    gpu = {"error": str(e)}
print(json.dumps({"gpu": gpu, "hostname": name, "ip": ip, "python": sys.version.split()[0],
    "executable": sys.executable,
    "torch": v("torch"), "horovod": v("horovod"), "hvdtrain": spec.origin if spec else None,
    "cwd": os.path.isdir(sys.argv[1]), "nic": (not nic) or os.path.exists("/sys/class/net/" + nic),
    "nics": sorted(os.listdir("/sys/class/net")) if os.path.isdir("/sys/class/net") else []}))
"""


def _local_addresses() -> set[str]:
    import psutil

    return {a.address for addrs in psutil.net_if_addrs().values() for a in addrs}


def is_local(host: str, local: set[str]) -> bool:
    """Like horovodrun: a host whose address is one of ours is started without ssh."""
    try:
        return socket.gethostbyname(host) in local
    except OSError:
        return False


def probe(host: str, local: bool, nic: str, ssh_port: int | None) -> dict:
    """Facts about `host`, or {"error": "..."}; runs the probe over ssh unless the host is local."""
    code = [sys.executable, "-c", _PROBE, os.getcwd(), nic or ""]
    if not local:
        port = ["-p", str(ssh_port)] if ssh_port else []
        # Same options horovodrun's own ssh check uses, plus a timeout so a dead host fails fast.
        code = ["ssh", "-o", "PasswordAuthentication=no", "-o", "StrictHostKeyChecking=no", "-o",
                f"ConnectTimeout={SSH_TIMEOUT_S}", "-o", "BatchMode=yes", *port, host, shlex.join(code)]
    try:
        out = subprocess.run(code, capture_output=True, text=True, timeout=SSH_TIMEOUT_S + 20, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return {"error": f"no answer within {SSH_TIMEOUT_S + 20} s"}
    if out.returncode == 255 and not local:
        return {"error": f"not reachable over ssh: {last_line(out.stderr)}"}
    if out.returncode != 0:
        return {"error": f"{sys.executable} failed there (same Python path needed on every host): "
                         f"{last_line(out.stderr)}"}
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": f"unexpected probe output: {last_line(out.stdout)}"}


def host_problems(host: str, facts: dict, ref: dict, nic: str, controller: str, slots: int | None = None,
                  alone: bool = False) -> list[str]:
    """One line per problem on `host`, compared with the launcher's own facts `ref`; the GPU
    checks are `hvdtrain doctor`'s (hvdtrain/tools/doctor.py). `alone`: the only host of the run."""
    if "error" in facts:
        return [f"host {host}: {facts['error']}"]
    from hvdtrain.tools import doctor

    gpu = facts.get("gpu") or {}
    out = [f"host {host}: {line}" for line in ([] if "error" in gpu else doctor.problems(gpu, slots))]
    for key, what in (("python", "Python"), ("torch", "torch"), ("horovod", "Horovod")):
        if facts.get(key) != ref.get(key):
            out.append(f"host {host}: {what} {facts.get(key) or 'missing'}, launcher has {ref.get(key)}")
    if facts.get("hvdtrain") != ref.get("hvdtrain"):
        where = facts.get("hvdtrain") or "missing"
        out.append(f"host {host}: hvdtrain at {where}, launcher uses {ref.get('hvdtrain')} (same code path needed)")
    if not facts.get("cwd"):
        out.append(f"host {host}: working directory {os.getcwd()} does not exist (ranks start there)")
    if not facts.get("nic"):
        out.append(f"host {host}: network interface {nic} not found (has: {', '.join(facts.get('nics', []))})")
    ip = facts.get("ip")
    # Gloo trap 1: Gloo binds to what gethostname() resolves to, ignoring --network-interface.
    # Alone, its ranks meet on loopback anyway (a one-node Slurm job, a workstation).
    if controller == "gloo" and not alone and (ip is None or ip.startswith("127.")):
        seen = f"resolves to loopback {ip}" if ip else "does not resolve"
        out.append(f"host {host}: hostname {facts.get('hostname')} {seen}; Gloo needs it to resolve to the "
                   "host's routable address (fix /etc/hosts, e.g. remove a '127.0.1.1 <hostname>' line)")
    return out


def preflight(hosts: list[Host], nic: str, controller: str, ssh_port: int | None = None) -> list[str]:
    """Check every host in parallel; returns the problem lines (empty when all is well)."""
    local = _local_addresses()
    flags = [is_local(h.name, local) for h in hosts]
    with ThreadPoolExecutor(max_workers=min(32, len(hosts) + 1)) as pool:
        ref_job = pool.submit(probe, "localhost", True, "", None)
        jobs = [pool.submit(probe, h.name, f, nic, ssh_port) for h, f in zip(hosts, flags)]
        ref = ref_job.result()
        return [line for h, j in zip(hosts, jobs)
                for line in host_problems(h.name, j.result(), ref, nic, controller, h.slots, len(hosts) == 1)]


def _at_least(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: a whole number in [low, high]; anything else is one usage line."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{value} is out of range: expected {low}" +
                                             (f" to {high}" if high is not None else " or more"))
        return value
    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hosts", help="host list like h1:2,h2:1 (default: --hostfile, the Slurm allocation, or with "
                   "-np alone this machine)")
    p.add_argument("--hostfile", help="hostfile with 'host slots=N' lines")
    p.add_argument("--host-discovery-script", metavar="COMMAND",
                   help="elastic mode: command printing host:slots lines (e.g. 'scripts/discover_hosts.sh hosts.txt')")
    p.add_argument("--min-np", type=_at_least(1), help="elastic: fewest ranks to keep training with (default 1)")
    p.add_argument("--max-np", type=_at_least(1), help="elastic: most ranks (default: the slots discovered now)")
    p.add_argument("--elastic-timeout", type=_at_least(1), metavar="S",
                   help="elastic: how long to wait for --min-np workers (at the start, or after hosts left) "
                        "before the job stops (default: horovodrun's, 600 s)")
    p.add_argument("--blacklist-cooldown", type=_at_least(0), nargs=2, metavar=("MIN_S", "MAX_S"),
                   help="elastic: a failed host may rejoin after this many seconds (default: never)")
    p.add_argument("-np", "--np", type=_at_least(1), help="number of ranks (default: all slots)")
    p.add_argument("--controller", choices=("gloo", "mpi"), default="gloo", help="Horovod controller (default gloo)")
    p.add_argument("--network-interface", help="NIC for Horovod traffic, checked on every host (e.g. eth0, ib0)")
    p.add_argument("--mpi-allreduce", choices=("ring", "default"), default="ring",
                   help="MPI only: force Open MPI's ring allreduce (default) or keep its own choice")
    p.add_argument("--mpi-args", default="", help="extra mpirun arguments (not --mca btl: horovodrun sets it)")
    p.add_argument("--ssh-port", type=_at_least(1, 65535), help="ssh port on the hosts")
    p.add_argument("--ssh-alive", type=_at_least(0), default=30, metavar="S",
                   help="end an ssh session to a host that stops answering after about S s (ServerAlive), so "
                        "a lost link ends the job, or drops the host from an elastic one (0: leave ssh alone)")
    p.add_argument("--no-preflight", action="store_true", help="skip the checks over ssh")
    p.add_argument("--dry-run", action="store_true", help="print the horovodrun command and exit")
    p.add_argument("program", nargs=argparse.REMAINDER, metavar="COMMAND", help="-- COMMAND ... to run on every rank")


def main(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> int:
    """Resolve hosts, check them, then run horovodrun, relaying stop signals to the ranks."""
    hosts = resolve_hosts(args, os.environ if env is None else env)
    cmd = build_command(args, hosts)
    if args.dry_run:
        print(shlex.join(cmd), flush=True)
        return 0
    if not args.no_preflight:
        problems = preflight(hosts, args.network_interface or "", args.controller, args.ssh_port)
        for line in problems:
            print(f"hvdtrain: preflight: {line}", file=sys.stderr, flush=True)
        if problems:
            raise PreflightError(f"preflight failed: {len(problems)} problem(s) on "
                                 f"{len({p.split(':')[0] for p in problems})} host(s); nothing was started")
        print(f"hvdtrain: preflight ok: {len(hosts)} host(s), {sum(h.slots for h in hosts)} slot(s)", flush=True)
    print(f"hvdtrain: {shlex.join(cmd)}", flush=True)
    from hvdtrain.stop import EXIT_STOPPED
    from hvdtrain.tools import relay

    # Not exec: stop signals sent to the launcher (Slurm's --signal=B:USR1@90, scancel --signal,
    # kill) reach the ranks as a graceful stop, and the launcher's exit code says so (relay.py).
    local = _local_addresses()
    return relay.run(cmd, hosts, [is_local(h.name, local) for h in hosts], args.ssh_port, EXIT_STOPPED,
                     args.ssh_alive)
