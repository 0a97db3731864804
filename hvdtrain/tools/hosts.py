"""Host lists for multi-host launches: `--hosts`, hostfiles, Slurm's compressed node and task lists
(`node[01-03,07]`, `2(x3),1`) and host discovery scripts (what horovodrun's elastic mode runs).
Every problem is a LaunchError naming the input and what was expected."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from hvdtrain.errors import HvdtrainError


class LaunchError(HvdtrainError):
    """A bad host list, Slurm variable or launch option."""


@dataclass(frozen=True)
class Host:
    name: str
    slots: int


def _split_top(text: str) -> list[str]:
    """Split on commas outside brackets: `a[1-2],b` -> ['a[1-2]', 'b']."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch == "[") - (ch == "]")
        if depth < 0 or depth > 1:
            raise LaunchError(f"bad Slurm node list {text!r}: unbalanced or nested brackets")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if depth:
        raise LaunchError(f"bad Slurm node list {text!r}: unclosed '['")
    return parts + [cur]


def _expand_range(item: str, whole: str) -> list[str]:
    m = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
    if not m:
        raise LaunchError(f"bad Slurm node list {whole!r}: {item!r} is not a number or range")
    lo, hi = m.group(1), m.group(2) or m.group(1)
    if int(hi) < int(lo):
        raise LaunchError(f"bad Slurm node list {whole!r}: range {item!r} runs backwards")
    width = len(lo)  # Slurm keeps the zero padding of the range start: node[08-10]
    return [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]


def expand_nodelist(text: str) -> list[str]:
    """Expand a Slurm node list (`node[01-03,07],gpu-a[1-2]-ib`) into host names, in order."""
    names: list[str] = []
    for part in _split_top(text.strip()):
        if not part:
            raise LaunchError(f"bad Slurm node list {text!r}: empty entry")
        # Each [..] group multiplies out, so rack[1-2]-n[1-2] gives 4 names.
        expanded = [""]
        for literal, group in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", part):
            options = [literal]
            if group:
                options = [literal + x for item in group.split(",") for x in _expand_range(item, text)]
            expanded = [e + o for e in expanded for o in options]
        names += expanded
    return names


def expand_tasks_per_node(text: str) -> list[int]:
    """Expand SLURM_TASKS_PER_NODE (`2(x3),1` -> [2, 2, 2, 1])."""
    counts: list[int] = []
    for item in text.strip().split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not m or int(m.group(1)) < 1:
            raise LaunchError(f"bad SLURM_TASKS_PER_NODE {text!r}: expected entries like 2 or 2(x3)")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def hosts_from_slurm(env: Mapping[str, str]) -> list[Host]:
    """Hosts and slots of the current Slurm allocation."""
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise LaunchError("no host list: pass --hosts or --hostfile, or run inside a Slurm job (SLURM_JOB_NODELIST)")
    names = expand_nodelist(nodelist)
    if env.get("SLURM_TASKS_PER_NODE"):
        slots = expand_tasks_per_node(env["SLURM_TASKS_PER_NODE"])
    elif env.get("SLURM_NTASKS_PER_NODE"):
        slots = expand_tasks_per_node(env["SLURM_NTASKS_PER_NODE"]) * len(names)
    else:
        slots = [1] * len(names)
    if len(slots) == 1:
        slots = slots * len(names)
    if len(slots) != len(names):
        raise LaunchError(f"Slurm gives {len(names)} nodes ({nodelist}) but {len(slots)} task counts "
                          f"({env.get('SLURM_TASKS_PER_NODE') or env.get('SLURM_NTASKS_PER_NODE')})")
    return [Host(n, s) for n, s in zip(names, slots)]


def parse_hosts(text: str) -> list[Host]:
    """Parse horovodrun's `-H` form: `h1:2,h2:1` (slots default to 1)."""
    hosts = []
    for item in text.split(","):
        name, _, slots = item.strip().partition(":")
        if not name or (slots and not slots.isdigit()) or (slots and int(slots) == 0):
            raise LaunchError(f"bad --hosts entry {item!r}: expected host or host:slots with slots >= 1, "
                              "e.g. h1:2,h2:1")
        hosts.append(Host(name, int(slots or 1)))
    return unique(hosts, "--hosts")


def unique(hosts: list[Host], where: str) -> list[Host]:
    """Refuse a host listed twice: horovodrun would give it the slots of one entry or the other."""
    seen: set[str] = set()
    for h in hosts:
        if h.name in seen:
            raise LaunchError(f"{where} lists host {h.name} twice; list it once with all its slots")
        seen.add(h.name)
    return hosts


def read_hostfile(path: str | Path) -> list[Host]:
    """Read a horovodrun/MPI hostfile: `host slots=N` per line, `#` comments."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise LaunchError(f"cannot read hostfile {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise LaunchError(f"hostfile {path} is not text; expected 'host slots=N' lines") from None
    hosts = []
    for no, line in enumerate(lines, 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"(\S+)(?:\s+slots\s*=\s*(\d+))?", line)
        if not m:
            raise LaunchError(f"hostfile {path} line {no}: expected 'host slots=N', got {line!r}")
        if m.group(2) is not None and int(m.group(2)) == 0:
            raise LaunchError(f"hostfile {path} line {no}: {m.group(1)} has 0 slots; give it at least 1 or remove it")
        hosts.append(Host(m.group(1), int(m.group(2) or 1)))
    if not hosts:
        raise LaunchError(f"hostfile {path} lists no hosts")
    return unique(hosts, f"hostfile {path}")


def check_discovery_script(command: str) -> None:
    """The script horovodrun will run about once a second must exist and be executable."""
    script = shlex.split(command)[0] if command.strip() else ""
    if not script or not Path(script).is_file():
        raise LaunchError(f"host discovery script {script or repr(command)} does not exist")
    if not os.access(script, os.X_OK):
        raise LaunchError(f"host discovery script {script} is not executable (chmod +x {script})")


def discover_hosts(command: str) -> list[Host]:
    """Run a host discovery script once (as horovodrun will) and parse its `host:slots` lines."""
    check_discovery_script(command)
    try:
        out = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise LaunchError(f"host discovery script {command!r} did not finish within 60 s") from None
    if out.returncode != 0:
        raise LaunchError(f"host discovery script {command!r} failed (exit {out.returncode}): {last_line(out.stderr)}")
    lines = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    if not lines:
        raise LaunchError(f"host discovery script {command!r} printed no hosts (expected host:slots lines)")
    return parse_hosts(",".join(lines))


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"
