"""`hvdtrain launch` as a signal relay: how a stop signal sent to the launcher reaches the ranks.

Neither launcher passes one on as a graceful stop: horovodrun (Gloo) answers SIGTERM by terminating
its local ranks and killing them 5 s later, and ignores nothing else (SIGUSR1 ends horovodrun
itself); Open MPI's mpirun forwards SIGUSR1 and SIGUSR2 but answers SIGTERM by killing the ranks
after 1 s, and horovodrun --mpi runs mpirun under its own Python process, which SIGUSR1 ends. So
`hvdtrain launch` runs horovodrun in a session of its own (a signal to the launcher's process group
does not reach it) and sends each stop signal it receives to the rank processes itself: those of
this host directly, those of other hosts over ssh. Ranks are found by the run's id in their
environment (HVDTRAIN_RUN_ID, which the launcher sets and horovodrun passes on) and Horovod's rank
variable; processes the ranks started (data workers) are left alone. One rank is enough, since the
ranks agree on a stop at the next step (hvdtrain/stop.py), but every rank found is sent it.

horovodrun exits 1 whatever its ranks' exit status; the launcher exits with EXIT_STOPPED when
horovodrun reports that a rank exited with it.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Sequence
from typing import IO

from hvdtrain.tools.hosts import Host

RUN_ID = "HVDTRAIN_RUN_ID"
RELAYED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)
_RANK_VARS = (b"HOROVOD_RANK=", b"OMPI_COMM_WORLD_RANK=", b"PMIX_RANK=")
# horovodrun's words for a rank's exit status: Gloo "Exit code: 99", MPI "mpirun failed with exit code 99".
_EXIT = re.compile(r"exit code:? (\d+)", re.IGNORECASE)


def rank_pids(run_id: str) -> list[int]:
    """Pids of this host's rank processes of run `run_id` (not the processes they started)."""
    mine: dict[int, int] = {}  # pid -> parent pid
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if f"{RUN_ID}={run_id}".encode() in env and any(v.startswith(_RANK_VARS) for v in env):
            mine[int(entry)] = ppid
    return sorted(pid for pid, ppid in mine.items() if ppid not in mine)


def signal_ranks(run_id: str, signum: int) -> int:
    """Send `signum` to this host's ranks of the run; how many were found."""
    pids = rank_pids(run_id)
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass
    return len(pids)


def _remote(host: Host, run_id: str, signum: int, ssh_port: int | None) -> int:
    code = (f"from hvdtrain.tools.relay import signal_ranks; "
            f"print(signal_ranks({run_id!r}, {int(signum)}))")
    port = ["-p", str(ssh_port)] if ssh_port else []
    cmd = ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no", "-o", "ConnectTimeout=10", *port,
           host.name, shlex.join([sys.executable, "-c", code])]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
        return int(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else 0
    except (subprocess.TimeoutExpired, ValueError, IndexError):
        return 0


def relay(signum: int, run_id: str, hosts: Sequence[Host], local: Sequence[bool], ssh_port: int | None) -> int:
    """Send `signum` to every rank of the run, here and over ssh; how many ranks were reached."""
    reached = signal_ranks(run_id, signum) if any(local) else 0
    remote = [h for h, is_local in zip(hosts, local) if not is_local]
    threads, counts = [], [0] * len(remote)

    def one(i: int) -> None:
        counts[i] = _remote(remote[i], run_id, signum, ssh_port)

    for i in range(len(remote)):
        threads.append(threading.Thread(target=one, args=(i,), daemon=True))
        threads[-1].start()
    for t in threads:
        t.join(40)
    return reached + sum(counts)


def _copy(src: IO[str], dst: IO[str], seen: list[int]) -> None:
    """horovodrun's output to ours, whole lines; the exit codes it reports are kept."""
    for line in src:
        dst.write(line)
        dst.flush()
        seen += [int(code) for code in _EXIT.findall(line)]


def run(cmd: list[str], hosts: Sequence[Host], local: Sequence[bool], ssh_port: int | None,
        stopped_code: int) -> int:
    """Run horovodrun, relaying stop signals to the ranks; its exit code, or `stopped_code` when a
    rank exited with it."""
    run_id = uuid.uuid4().hex
    env = dict(os.environ, **{RUN_ID: run_id})
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1)
    seen: list[int] = []
    copier = threading.Thread(target=_copy, args=(proc.stdout, sys.stdout, seen), daemon=True)
    copier.start()

    def on_signal(signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        # Relayed from a thread: the handler must return to let the main thread go on waiting.
        def send() -> None:
            n = relay(signum, run_id, hosts, local, ssh_port)
            print(f"hvdtrain: launch: {name}: sent to {n} rank process(es); they stop at the next step, after a "
                  "checkpoint", file=sys.stderr, flush=True)
        threading.Thread(target=send, daemon=True).start()

    def on_interrupt(signum: int, frame: object) -> None:
        proc.send_signal(signal.SIGINT)  # Ctrl-C: horovodrun's own teardown of the ranks

    previous = {s: signal.signal(s, on_signal) for s in RELAYED}
    previous[signal.SIGINT] = signal.signal(signal.SIGINT, on_interrupt)
    try:
        rc = proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    copier.join(10)
    return stopped_code if rc != 0 and seen[:1] == [stopped_code] else rc
