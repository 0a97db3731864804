"""Bad input to `hvdtrain launch` and `hvdtrain train`: one line on stderr naming the problem, exit 2,
no file written. Run in-process (size 1): each case fails before any collective."""

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from hvdtrain.tools.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _script(folder: Path, body: str, mode: int = 0o755) -> str:
    path = folder / "discover.sh"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(mode)
    return str(path)


def _hostfile(folder: Path, text: str) -> str:
    (folder / "hosts").write_text(text)
    return str(folder / "hosts")


def _state(folder: Path, content: object, truncate: bool = False) -> str:
    path = folder / "ckpt" / "state.pt"
    path.parent.mkdir()
    torch.save(content, path)
    if truncate:
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    return str(path.parent)


LAUNCH = {
    "hostfile missing": (lambda d: ["--hostfile", str(d / "nope")], "cannot read hostfile {d}/nope: No such file"),
    "hostfile bad line": (lambda d: ["--hostfile", _hostfile(d, "h1 slots=2\nh2 cpus=2\n")],
                          "hostfile {d}/hosts line 2: expected 'host slots=N', got 'h2 cpus=2'"),
    "hostfile zero slots": (lambda d: ["--hostfile", _hostfile(d, "h1 slots=0\n")],
                            "hostfile {d}/hosts line 1: h1 has 0 slots; give it at least 1 or remove it"),
    "hostfile without hosts": (lambda d: ["--hostfile", _hostfile(d, "# none yet\n")],
                               "hostfile {d}/hosts lists no hosts"),
    "min-np above max-np": (lambda d: ["--host-discovery-script", _script(d, "echo localhost:3"), "--min-np", "3",
                                       "--max-np", "2"], "--min-np 3 is more than --max-np 2"),
    "discovery script missing": (lambda d: ["--host-discovery-script", f"{d}/nope.sh arg"],
                                 "host discovery script {d}/nope.sh does not exist"),
    "discovery script not executable": (lambda d: ["--host-discovery-script", _script(d, "echo a:1", 0o644)],
                                        "host discovery script {d}/discover.sh is not executable (chmod +x"),
    "discovery script fails": (lambda d: ["--host-discovery-script", _script(d, "echo no list >&2; exit 3")],
                               "failed (exit 3): no list"),
    "discovery script prints no host": (lambda d: ["--host-discovery-script", _script(d, "true")],
                                        "printed no hosts (expected host:slots lines)"),
    "elastic on MPI": (lambda d: ["--host-discovery-script", _script(d, "echo a:2"), "--controller", "mpi"],
                       "elastic training runs on Gloo only"),
    "min-np without discovery": (lambda d: ["--hosts", "a:2", "--min-np", "1"],
                                 "--min-np/--max-np need --host-discovery-script"),
}

TRAIN = {
    "data path is a file": (lambda d: ["--task", "pylm", "--set", f"data.path={_hostfile(d, 'x')}"],
                            "data.path {d}/hosts does not exist or is not a folder"),
    "data path without source": (lambda d: ["--task", "pylm", "--set", f"data.path={d}"],
                                 "data.path {d} holds only 0 bytes of .py source"),
    "not a checkpoint": (lambda d: ["--resume", _state(d, torch.zeros(3))],
                         "checkpoint {d}/ckpt/state.pt is not an hvdtrain checkpoint (format 1 expected)"),
    "truncated checkpoint": (lambda d: ["--resume", _state(d, {"format": 1, "w": torch.zeros(10_000)}, truncate=True)],
                             "checkpoint {d}/ckpt/state.pt is corrupt or not an hvdtrain checkpoint"),
    "elastic commit interval": (lambda d: ["--elastic", "--set", "elastic.commit_every=0"],
                                "elastic.commit_every=0 must be >= 1"),
}


def _check(capsys, tmp_path: Path, argv: list[str], message: str) -> None:
    before = sorted(tmp_path.rglob("*"))
    assert main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("hvdtrain: error: "), err
    assert message.format(d=tmp_path) in err[0], err
    assert sorted(tmp_path.rglob("*")) == before, "a failed start must not write files"


@pytest.mark.parametrize("case", sorted(LAUNCH))
def test_launch_bad_input(case, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args, message = LAUNCH[case]
    argv = ["launch", "--no-preflight", "--dry-run", *args(tmp_path), "--", "hvdtrain", "train"]
    _check(capsys, tmp_path, argv, message)


@pytest.mark.parametrize("case", sorted(TRAIN))
def test_train_bad_input(case, tmp_path, capsys, world):
    args, message = TRAIN[case]
    argv = ["train", "--set", "log.progress=false", "--set", f"log.dir={tmp_path}/run", *args(tmp_path)]
    _check(capsys, tmp_path, argv, message)


def test_launch_without_horovodrun_anywhere(tmp_path):
    # An interpreter with no horovodrun beside it and a PATH without one: the situation of a
    # Python environment where Horovod's launcher was never installed.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(os.path.realpath(sys.executable))
    site = sysconfig.get_paths()["purelib"]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{ROOT}:{site}", "HOME": str(tmp_path)}
    res = subprocess.run([str(bin_dir / "python3"), "-m", "hvdtrain.tools.cli", "launch", "--hosts", "localhost",
                          "--no-preflight", "--", "true"], capture_output=True, text=True, env=env, timeout=60)
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines() == [
        f"hvdtrain: error: horovodrun not found next to {bin_dir / 'python3'} or on PATH; install Horovod "
        "(./scripts/install.sh) or activate the environment that has it"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin"]
