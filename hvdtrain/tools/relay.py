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
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Sequence
from typing import IO

from hvdtrain.tools.hosts import Host

RUN_ID = "HVDTRAIN_RUN_ID"
RELAYED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)
_RANK_VARS = (b"HOROVOD_RANK=", b"OMPI_COMM_WORLD_RANK=", b"PMIX_RANK=")
# horovodrun's words for a rank's exit status: Gloo "Exit code: 99", MPI "Exit code:    99" and
# "mpirun failed with exit code 99"; for the rank that exited first: Gloo "Process name: 1", MPI
# "Process name: [[31524,1],1]" (job id, then the rank).
_EXIT = re.compile(r"exit code:?\s+(\d+)", re.IGNORECASE)
_FIRST = re.compile(r"^\s*Process name:\s+(?:\[\[\d+,\d+\],)?(\d+)\]?\s*$")
# Lines that ranks print carry horovodrun's tag ("[1]<stderr>:" or "[1,1]<stderr>:"); the others are its own.
# The elastic driver's words when fewer than --min-np workers remain for --elastic-timeout seconds.
_TOO_FEW = re.compile(r"enough resources to run at least (\d+) Horovod processes.*Timeout after (\d+) seconds")
_TAGGED = re.compile(r"^\[\d+(?:,\d+)?\]<std(?:out|err)>:")
_ANY_TAG = re.compile(r"\[\d+(?:,\d+)?\]<std(?:out|err)>:")
_RANK0 = re.compile(r"^\[(?:\d+,)?0\]<std(?:out|err)>:")


def clean(line: str) -> list[str]:
    """A line as the user should see it: cut where Open MPI glued another write's tag into it, and
    without rank 0's tag (the rank that speaks for the job); other ranks' lines keep their tag."""
    cuts = [m.start() for m in _ANY_TAG.finditer(line) if m.start() > 0]
    parts = [line[a:b] for a, b in zip([0, *cuts], [*cuts, len(line)])]
    out = []
    for part in parts:
        text = _RANK0.sub("", part)
        if _ANY_TAG.sub("", part).strip() or part is parts[0]:  # a bare tag: the glued line's newline
            out.append(text if text.endswith("\n") else text + "\n")
    return out


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


def _ssh(host: str, ssh_port: int | None, command: str, connect_s: int = 10) -> list[str]:
    port = ["-p", str(ssh_port)] if ssh_port else []
    return ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no", "-o", f"ConnectTimeout={connect_s}",
            *port, host, command]


def _remote(host: Host, run_id: str, signum: int, ssh_port: int | None) -> int:
    code = (f"from hvdtrain.tools.relay import signal_ranks; "
            f"print(signal_ranks({run_id!r}, {int(signum)}))")
    cmd = _ssh(host.name, ssh_port, shlex.join([sys.executable, "-c", code]))
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
        return int(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else 0
    except (subprocess.TimeoutExpired, ValueError, IndexError):
        return 0


def unreachable(hosts: Sequence[Host], local: Sequence[bool], ssh_port: int | None) -> list[str]:
    """One line per remote host that does not answer over ssh within 10 s (checked in parallel):
    after a failed run, the likeliest cause is a link or a host that went down."""
    remote = [h.name for h, is_local in zip(hosts, local) if not is_local]
    why: dict[str, str] = {}

    def check(name: str) -> None:
        try:
            out = subprocess.run(_ssh(name, ssh_port, "true", 5), capture_output=True, text=True, timeout=10,
                                 stdin=subprocess.DEVNULL)
            if out.returncode != 0:
                why[name] = (out.stderr.strip().splitlines() or [f"ssh exit {out.returncode}"])[-1]
        except subprocess.TimeoutExpired:
            why[name] = "no answer within 10 s"

    threads = [threading.Thread(target=check, args=(name,), daemon=True) for name in remote]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    return [f"hvdtrain: launch: host {name} does not answer over ssh ({why[name]}): its link or the host itself "
            "is down, and the job stopped; rerun once it is back, or without it, with --resume auto to continue "
            "from the last checkpoint" for name in remote if name in why]


def keepalive_ssh(folder: str, seconds: int) -> str:
    """An `ssh` for horovodrun and mpirun to find first on PATH: the real one with ServerAlive
    options, so a session to a host that stops answering (a link down, a switch port, a firewall)
    ends after about `seconds` instead of TCP's ~2 hours; then horovodrun or mpirun sees the
    rank or its daemon gone and ends the job (an elastic job goes on without the host). Returns
    the folder to put first on PATH."""
    real = shutil.which("ssh") or "/usr/bin/ssh"
    interval = max(1, seconds // 3)
    path = os.path.join(folder, "ssh")
    with open(path, "w") as f:
        f.write(f"#!/bin/sh\nexec {shlex.quote(real)} -o ServerAliveInterval={interval} "
                f"-o ServerAliveCountMax=3 \"$@\"\n")
    os.chmod(path, 0o755)
    return folder


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


class Exits:
    """What horovodrun says of its ranks' exits: the codes, in order, and the rank that exited first."""

    def __init__(self) -> None:
        self.codes: list[int] = []
        self.first: int | None = None
        self.too_few: tuple[int, int] | None = None  # (min-np, timeout s): the elastic driver gave up
        self.daemon_lost: list[str] = []  # Open MPI's notice that a host's daemon went away

    def read(self, line: str) -> None:
        if _TAGGED.match(line):
            return  # a rank's own words, not horovodrun's
        self.codes += [int(code) for code in _EXIT.findall(line)]
        few = _TOO_FEW.search(line)
        if few and self.too_few is None:
            self.too_few = (int(few.group(1)), int(few.group(2)))
        m = _FIRST.match(line)
        if m and self.first is None:
            self.first = int(m.group(1))


_DAEMON_LOST = "ORTE was unable to reliably start one or more daemons"


def _copy(src: IO[str], dst: IO[str], exits: Exits) -> None:
    """horovodrun's output to ours, whole lines, reading the exits it reports. Two failure texts are
    held back, to be replaced by one line when the launcher knows their cause: horovodrun's (Gloo)
    own Python traceback at the end of a failed run, ~20 lines that only say a rank exited first (in
    elastic mode, ~80 more of its HTTP server's broken pipes), by `summary`'s line; and Open MPI's
    20-line lost-daemon notice (libraries, /tmp, Cray...) when a host's ssh session ended, kept in
    `exits.daemon_lost` for `_run` to show only if no host is found down."""
    held: list[str] = []
    block: list[str] = []  # an Open MPI notice between two rules of dashes
    for line in src:
        exits.read(line)
        untagged = not _TAGGED.match(line)
        if untagged and line.startswith("-----") and not held:
            block.append(line)
            if len(block) > 1:
                if any(_DAEMON_LOST in b for b in block):
                    exits.daemon_lost = block
                    dst.writelines(b for b in block if _TAGGED.match(b))
                else:
                    dst.writelines(block)
                block = []
            continue
        if block:
            block.append(line)
            continue
        if held or (line.startswith("Traceback (most recent call last)") and untagged):
            held.append(line)
            continue
        dst.writelines(clean(line))
        dst.flush()
    dst.writelines(block)  # an unfinished notice: as it is
    known = exits.too_few is not None or any("processes exited with non-zero status" in line for line in held)
    if held and not known:
        dst.writelines(held)  # some other failure of horovodrun itself: show it whole
    dst.flush()


def summary(exits: Exits, rc: int, stopped_code: int) -> str | None:
    """One line on how the run ended, when a rank failed."""
    if exits.too_few is not None:  # the job stopped short, whatever horovodrun's own exit code
        low, seconds = exits.too_few
        return (f"hvdtrain: launch: fewer than --min-np {low} workers were left for {seconds} s (--elastic-timeout), "
                "so the elastic job stopped; add hosts (or lower --min-np) and rerun with --resume auto to "
                "continue from the last checkpoint")
    if rc == 0 or exits.first is None or exits.codes[:1] == [stopped_code]:
        return None
    code = f" with code {exits.codes[0]}" if exits.codes else ""
    return (f"hvdtrain: launch: rank {exits.first} exited first{code}, and the other ranks were stopped; its "
            "lines above (tagged with its rank) say why. Fix that and rerun with --resume auto to continue "
            "from the last checkpoint")


def run(cmd: list[str], hosts: Sequence[Host], local: Sequence[bool], ssh_port: int | None,
        stopped_code: int, ssh_alive_s: int = 30) -> int:
    """Run horovodrun, relaying stop signals to the ranks; its exit code, or `stopped_code` when a
    rank exited with it. `ssh_alive_s` > 0: ssh sessions to hosts that stop answering end after
    about that long (`keepalive_ssh`)."""
    with tempfile.TemporaryDirectory(prefix="hvdtrain-launch-") as folder:
        env = dict(os.environ, **{RUN_ID: uuid.uuid4().hex})
        if ssh_alive_s > 0 and not all(local):
            env["PATH"] = keepalive_ssh(folder, ssh_alive_s) + os.pathsep + env.get("PATH", "")
        return _run(cmd, env, hosts, local, ssh_port, stopped_code)


def _run(cmd: list[str], env: dict[str, str], hosts: Sequence[Host], local: Sequence[bool], ssh_port: int | None,
         stopped_code: int) -> int:
    run_id = env[RUN_ID]
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1)
    exits = Exits()
    copier = threading.Thread(target=_copy, args=(proc.stdout, sys.stdout, exits), daemon=True)
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
    if rc == 0 and exits.too_few is not None:
        # The elastic driver stopped the job for too few workers, yet horovodrun can exit 0 (the
        # survivors were told to stop and did): the training did not finish.
        rc = 1
    stopped = exits.codes[:1] == [stopped_code]
    down = unreachable(hosts, local, ssh_port) if rc != 0 and not stopped else []
    # Whatever horovodrun or mpirun said (a rank exited first, a daemon went away), a host that no
    # longer answers is the cause: name it, instead of the effects.
    lines = down or exits.daemon_lost
    if not down or exits.too_few:
        lines = [*lines, summary(exits, rc, stopped_code) or ""]
    for line in lines:
        if line:
            print(line.rstrip("\n"), file=sys.stderr, flush=True)
    return stopped_code if rc != 0 and stopped else rc
