"""Launching benchmark workers, shared by the bench commands that start their own ranks: horovodrun
on this host or across hosts, each launch in a session of its own (a timeout ends every rank), and
the JSON records its ranks printed, found in the launcher's tagged output."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

# Variants of a controller (gloo-cycling, mpi-yielding...): the same build with one of hvdtrain's
# Horovod patches switched back to upstream, so a lever is measured against its absence in one
# interleaved run:
# *-cycling: the background loop runs a coordination round every cycle (HOROVOD_IDLE_SLEEP_MS=0);
# *-yielding: hvd.synchronize polls and yields instead of sleeping (HOROVOD_WAIT_YIELD=1);
# *-upstream: both.
VARIANTS: dict[str, dict[str, str]] = {
    "cycling": {"HOROVOD_IDLE_SLEEP_MS": "0"},
    "yielding": {"HOROVOD_WAIT_YIELD": "1"},
    "upstream": {"HOROVOD_IDLE_SLEEP_MS": "0", "HOROVOD_WAIT_YIELD": "1"},
}


def controller(ctrl: str) -> str:
    """The Horovod controller a way runs under (mpi-direct and the mpi-* variants are MPI's)."""
    return ctrl.split("-")[0]


def variant_env(ctrl: str) -> dict[str, str]:
    """The environment a variant adds (its part of Horovod switched back to upstream)."""
    return dict(VARIANTS.get(ctrl.partition("-")[2], {}))


def horovodrun(ctrl: str, np: int, hosts: list[Any] | None = None) -> list[str]:
    """horovodrun up to the Python interpreter, on this host or across `hosts` (tools.hosts.Host).
    `ctrl` is the controller itself, gloo or mpi."""
    where = ["-H", ",".join(f"{h.name}:{h.slots}" for h in hosts)] if hosts else []
    if hosts and ctrl == "mpi":  # as `hvdtrain launch` runs it across hosts
        from hvdtrain.tools.launch import MPI_RING_ARGS

        where.append(f"--mpi-args={MPI_RING_ARGS}")
    return [str(Path(sys.executable).parent / "horovodrun"), "-np", str(np), *where, f"--{ctrl}", sys.executable]


def records(text: str, kind: str | None = None) -> list[dict[str, Any]]:
    """The records `hvdtrain.bench.emit` printed, found in launcher output (only those of `kind` if
    given). Rank tags are removed wherever they stand and JSON is decoded wherever it starts, because
    Open MPI sometimes glues the next line (or its tag) onto a line."""
    text = re.sub(r"\[\d+(?:,\d+)?\]<std(?:out|err)>:", "", text)
    decoder, out, i = json.JSONDecoder(), [], text.find('{"bench"')
    while i != -1:
        obj, end = decoder.raw_decode(text, i)
        if kind is None or obj.get("bench") == kind:
            out.append(obj)
        i = text.find('{"bench"', end)
    return out


def launch(cmds: list[list[str]], env: dict[str, str], timeout: float, kind: str) -> list[dict[str, Any]]:
    """Run the commands together (one per host for multi-host DDP, else one) and return the records."""
    # Sessions of their own, so a timeout (or Ctrl-C) ends mpirun/ssh and every rank, not just the launcher.
    procs = [subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for c in cmds]
    outs, shown = [], " & ".join(" ".join(c) for c in cmds)
    try:
        for proc in procs:
            outs.append(proc.communicate(timeout=timeout)[0])
    except BaseException:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        out = "".join(proc.communicate()[0] or "" for proc in procs)
        raise RuntimeError(f"stopped (timeout {timeout} s or interrupt): {shown}\n{out[-4000:]}") from None
    out = "".join(outs)
    recs = records(out, kind)
    if any(p.returncode != 0 for p in procs) or not recs:
        raise RuntimeError(f"exit {[p.returncode for p in procs]}, no {kind} record: {shown}\n{out[-4000:]}")
    return recs
