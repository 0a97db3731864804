"""Run commands (horovodrun, the CLI) under a hard timeout; on a hang or failure show each rank's
last output lines so the log says which rank stopped where."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# horovodrun tags lines "[1]<stdout>:" (Gloo) or "[1,1]<stdout>:" (MPI); the last number is the rank.
_TAG = re.compile(r"^\[(?:\d+,)?(\d+)\]<(?:stdout|stderr)>:")


def untag(text: str) -> str:
    """Output without horovodrun's rank tags. Open MPI sometimes glues the next line's tag to the end
    of a line ("...0.9944[1,0]<stdout>:"), so tags are removed wherever they stand."""
    return re.sub(r"\[\d+(?:,\d+)?\]<std(?:out|err)>:", "", text)


def env(**extra: str) -> dict[str, str]:
    e = dict(os.environ)
    e["PATH"] = f"{BIN}:{e.get('PATH', '')}"
    e.setdefault("OMP_NUM_THREADS", "1")
    e.pop("PYTEST_CURRENT_TEST", None)
    e.update(extra)
    return e


def rank_tails(output: str, lines: int = 15) -> str:
    by_rank: dict[str, list[str]] = {}
    for line in output.splitlines():
        m = _TAG.match(line)
        by_rank.setdefault(m.group(1) if m else "launcher", []).append(line)
    parts = [f"--- {who}: last {lines} lines ---\n" + "\n".join(out[-lines:]) for who, out in sorted(by_rank.items())]
    return "\n".join(parts)


def run(cmd: list[str], timeout: float = 240, check: bool = True, split: bool = False,
        **kw) -> subprocess.CompletedProcess:
    """Run `cmd`, killing its whole process group after `timeout` seconds. `split` keeps stderr
    apart from stdout (default: merged into stdout)."""
    kw.setdefault("env", env())
    kw.setdefault("cwd", ROOT)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE if split else subprocess.STDOUT,
                            text=True, start_new_session=True, **kw)
    out, err = finish(proc, timeout, " ".join(cmd))
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, err or "")
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}: {' '.join(cmd)}\n{rank_tails(out, 40)}")
    return result


def finish(proc: subprocess.Popen, timeout: float, what: str = "") -> tuple[str, str]:
    """Wait for `proc` (started in a session of its own) and return its (stdout, stderr); after
    `timeout` seconds kill its whole process group and fail, showing each rank's last lines."""
    try:
        out, err = proc.communicate(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"timed out after {timeout:.0f} s: {what}\n{rank_tails(out + (err or ''), 40)}") from None
    return out, err or ""


def horovodrun(args: list[str], np: int = 2, controller: str = "gloo", **kw) -> subprocess.CompletedProcess:
    return run([str(BIN / "horovodrun"), "-np", str(np), f"--{controller}", *args], **kw)


def wait_for_step(out: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Wait until the run writing `out` has logged `step` to metrics.jsonl; fail if `proc` ends first."""
    metrics, deadline = out / "metrics.jsonl", time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"ended before step {step}:\n{proc.stdout.read()[-3000:] if proc.stdout else ''}")
        # only whole lines: the writer may be midway through the last one
        lines = metrics.read_text().split("\n")[:-1] if metrics.exists() else []
        if any(json.loads(line).get("step", 0) >= step for line in lines):
            return
        time.sleep(0.05)
    raise AssertionError(f"no step {step} within {timeout} s")
