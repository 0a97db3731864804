"""Bad input to `hvdtrain launch` and `hvdtrain train`: one line on stderr naming the problem, exit 2,
no file written. Run in-process (size 1): each case fails before any collective."""

import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import pytest
import torch
from helpers import tmpfs

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


def _file(folder: Path, name: str, data: str | bytes) -> str:
    path = folder / name
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return str(path)


RANDOM = bytes(range(128, 256)) * 3  # not UTF-8, as random bytes almost never are


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
                                 "--min-np/--max-np/--elastic-timeout need --host-discovery-script"),
    "host with 0 slots written 00": (lambda d: ["--hosts", "a:00"],
                                     "bad --hosts entry 'a:00': expected host or host:slots with slots >= 1"),
    "host listed twice": (lambda d: ["--hosts", "a:1,b:1,a:2"], "--hosts lists host a twice"),
    "host listed twice in a hostfile": (lambda d: ["--hostfile", _hostfile(d, "a slots=1\na slots=2\n")],
                                        "hostfile {d}/hosts lists host a twice"),
    "hostfile of random bytes": (lambda d: ["--hostfile", _file(d, "hosts", RANDOM)],
                                 "hostfile {d}/hosts is not text; expected 'host slots=N' lines"),
}

# argparse's own refusals: its usage, then one line naming the option and the range.
LAUNCH_NUMBERS = {
    "-np -1": (["-np", "-1"], "argument -np/--np: -1 is out of range: expected 1 or more"),
    "-np 0": (["-np", "0"], "argument -np/--np: 0 is out of range: expected 1 or more"),
    "--min-np 0": (["--min-np", "0"], "argument --min-np: 0 is out of range: expected 1 or more"),
    "--ssh-port 70000": (["--ssh-port", "70000"], "argument --ssh-port: 70000 is out of range: expected 1 to 65535"),
    "-np two": (["-np", "two"], "argument -np/--np: 'two' is not a whole number"),
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
    "config top level is a list": (lambda d: ["--config", _file(d, "c.yaml", "- train\n- optim\n")],
                                   "config file {d}/c.yaml must hold sections (train:, optim:, ...) at the top "
                                   "level, not a list"),
    "config top level is a string": (lambda d: ["--config", _file(d, "c.yaml", "digits\n")],
                                     "config file {d}/c.yaml must hold sections (train:, optim:, ...) at the top "
                                     "level, not a str"),
    "config of random bytes (YAML)": (lambda d: ["--config", _file(d, "c.yaml", RANDOM)],
                                      "config file {d}/c.yaml is not UTF-8 text; expected YAML"),
    "config of random bytes (TOML)": (lambda d: ["--config", _file(d, "c.toml", RANDOM)],
                                      "config file {d}/c.toml is not UTF-8 text; expected TOML"),
    "config is a folder": (lambda d: ["--config", str(d)], "config file {d} is a folder; give a YAML or TOML file"),
    "YAML key given twice": (lambda d: ["--config", _file(d, "c.yaml", "train:\n  epochs: 2\n  epochs: 3\n")],
                             "config file {d}/c.yaml: key 'epochs' appears twice in one section (line 3)"),
    "YAML key that is not a name": (lambda d: ["--config", _file(d, "c.yaml", "train:\n  5: 2\n")],
                                    "key 5 in train is not a name; allowed: accumulation"),
    "NaN for a number": (lambda d: ["--set", "optim.lr=.nan"], "optim.lr=nan must be a finite number"),
    "infinity for a number": (lambda d: ["--set", "train.stall_timeout=.inf"],
                              "train.stall_timeout=inf must be a finite number"),
    "NaN in a TOML file": (lambda d: ["--config", _file(d, "c.toml", "[optim]\nlr = nan\n")],
                           "optim.lr=nan must be a finite number"),
    "--out is a file": (lambda d: ["--set", f"log.dir={_file(d, 'f', 'x')}"],
                        "log.dir={d}/f is a file, not a folder; choose another path"),
    "--out under a file": (lambda d: ["--set", f"checkpoint.dir={_file(d, 'f', 'x')}/run/ck"],
                           "checkpoint.dir={d}/f/run/ck: {d}/f is a file, so no folder can be made under it"),
    "--out name too long": (lambda d: ["--set", f"log.dir={d}/{'x' * 300}"],
                            "is longer than 255 bytes; choose a shorter path"),
    "--out where no folder can be made": (lambda d: ["--set", "log.dir=/proc/hvdtrain-run"],
                                          "log.dir=/proc/hvdtrain-run: cannot create a folder in /proc"),
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


@pytest.mark.parametrize("case", sorted(LAUNCH_NUMBERS))
def test_launch_bad_numbers(case, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args, message = LAUNCH_NUMBERS[case]
    with pytest.raises(SystemExit) as exc:
        main(["launch", "--no-preflight", "--dry-run", "--hosts", "a:2", *args, "--", "hvdtrain", "train"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert exc.value.code == 2 and err[-1] == f"hvdtrain launch: error: {message}", err
    assert not list(tmp_path.iterdir())


@pytest.fixture
def read_only(tmp_path):
    """A read-only tmpfs (root only)."""
    with tmpfs(tmp_path / "ro", "ro,size=1m") as mount:
        yield mount


def test_out_on_a_read_only_file_system(read_only, tmp_path, capsys, world):
    argv = ["train", "--set", "log.progress=false", "--out", f"{read_only}/run"]
    _check(capsys, tmp_path, argv, f"log.dir={read_only}/run: {read_only} is on a read-only file system")


def test_out_without_permission(tmp_path):
    # As an ordinary user (root may write anywhere): `nobody` in a folder only root may write.
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv to run as another user")
    probe = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", ""],
                           capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:  # e.g. an interpreter whose libpython only root may read
        pytest.skip(f"this Python cannot run as user nobody: {probe.stderr.strip()[-200:]}")

    def as_nobody(out: Path) -> subprocess.CompletedProcess:
        return subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-m",
                               "hvdtrain.tools.cli", "train", "--task", "digits", "--out", str(out)],
                              capture_output=True, text=True, timeout=120, cwd=ROOT,
                              env={**os.environ, "HOME": "/nonexistent", "PYTHONPATH": str(ROOT)})

    locked = Path(tempfile.mkdtemp(prefix="hvdtrain-locked-"))  # 0700 and root's: nobody cannot look in
    try:
        res = as_nobody(locked / "run")
        assert res.returncode == 2, res.stderr[-2000:]
        assert res.stderr.strip().splitlines() == [f"hvdtrain: error: log.dir={locked}/run: no permission to look "
                                                   f"inside {locked} (as user nobody); choose a path this user can "
                                                   "reach"]
        locked.chmod(0o755)  # now nobody can look in, but not write
        res = as_nobody(locked / "run")
        assert res.returncode == 2, res.stderr[-2000:]
        assert res.stderr.strip().splitlines() == [f"hvdtrain: error: log.dir={locked}/run: no permission to "
                                                   f"write in {locked} (as user nobody); choose a writable path"]
        assert not list(locked.iterdir())
    finally:
        shutil.rmtree(locked)


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
