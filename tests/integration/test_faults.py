"""Fault tolerance: a hung rank stops the job, a kill never corrupts the latest checkpoint, and a
run killed at a random step resumes to bitwise the same weights."""

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from helpers import tmpfs
from launch import BIN, ROOT, env, horovodrun, run, untag

from hvdtrain.checkpoint import load_checkpoint

HERE = Path(__file__).parent
CLI = str(BIN / "hvdtrain")


def test_a_hung_rank_stops_the_job_within_the_timeout_naming_it():
    start = time.monotonic()
    res = horovodrun(["python", str(HERE / "scripts" / "stall.py"), "10"], controller="gloo", check=False,
                     timeout=120, env=env(PYTHONPATH=str(ROOT / "tests")))
    elapsed = time.monotonic() - start
    assert res.returncode != 0 and "finished without stalling" not in res.stdout
    culprit = f"rank 1 on {socket.gethostname()} made no progress"
    assert culprit in res.stdout, res.stdout[-3000:]
    assert "stuck in forward/backward of micro-batch 0 (loss_fn)" in res.stdout
    assert "rank 0 on" not in res.stdout  # the waiting rank's grace lets the culprit speak
    assert elapsed < 60, elapsed  # 10 s timeout + launch and start-up, not a hang


def test_kill_during_checkpoint_writes_never_breaks_latest(tmp_path):
    rng = random.Random(0)
    for trial in range(4):
        folder = tmp_path / f"t{trial}"
        proc = subprocess.Popen([sys.executable, str(HERE / "scripts" / "checkpoint_writer.py"), str(folder)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env(), cwd=ROOT)
        seen = 0
        while seen < 2 + trial:  # let it finish a few saves, then kill it mid-way through another
            line = proc.stdout.readline()
            assert line, "writer died"
            seen += line.startswith("saved")
        time.sleep(rng.uniform(0.0, 0.3))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        latest = (folder / "latest").read_text()
        state = load_checkpoint(folder / latest)
        assert torch.equal(state["model"]["w"], torch.full((4_000_000,), float(state["step"])))
        # keep=2, plus at most one complete folder whose pruning the kill interrupted
        assert len(list(folder.glob("step_*"))) <= 3


TRAIN = ["train", "--config", "configs/digits.yaml", "--set", "train.epochs=2", "--set", "log.every=1",
         "--set", "log.progress=false", "--set", "checkpoint.every=3", "--set", "log.tensorboard=false"]
LAST = 2 * (1617 // 64)


def _train(out: Path, *extra: str, **kw) -> subprocess.CompletedProcess:
    return horovodrun([CLI, *TRAIN, "--out", str(out), *extra], controller="mpi", timeout=200, **kw)


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


def test_kill_at_a_random_step_then_resume_gives_bitwise_equal_weights(tmp_path):
    whole = tmp_path / "whole"
    _train(whole)
    killed = tmp_path / "killed"
    target = random.Random(os.getpid()).randint(8, LAST - 10)
    args = [str(BIN / "horovodrun"), "-np", "2", "--mpi", CLI, *TRAIN, "--out", str(killed)]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env(), cwd=ROOT,
                            start_new_session=True)
    metrics, deadline = killed / "metrics.jsonl", time.monotonic() + 120
    while time.monotonic() < deadline:
        if metrics.exists() and f'"step": {target}, "kind": "train"' in metrics.read_text():
            break
        assert proc.poll() is None, "the run ended before it could be killed"
        time.sleep(0.02)
    # kill -9 the launcher and every rank at once (mpirun may start ranks outside our process group)
    tree = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()
    psutil.wait_procs([p for p in map(_process, tree) if p], timeout=30)
    stopped_at = load_checkpoint(killed / "checkpoints" / (killed / "checkpoints" / "latest").read_text())["step"]
    assert stopped_at < LAST, "the kill came too late to test anything"
    out = _train(killed, "--resume", "auto").stdout
    resumed = [line.rstrip() for line in untag(out).splitlines() if "resumed from" in line]
    assert resumed and resumed[0].endswith(f"resumed from {killed}/checkpoints/step_{stopped_at:08d}"), out[-2000:]
    final = [load_checkpoint(d / "checkpoints" / f"step_{LAST:08d}")["model"] for d in (whole, killed)]
    assert final[0].keys() == final[1].keys()
    assert all(torch.equal(final[0][k], final[1][k]) for k in final[0])


@pytest.fixture
def full_disk(tmp_path):
    """A 16 MiB tmpfs (root only) for the checkpoints; `fill()` takes its last free byte."""
    with tmpfs(tmp_path / "tmpfs", "size=16m") as mount:
        def fill() -> None:
            with open(mount / "filler", "wb") as f, contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()

        yield mount, fill


@pytest.mark.parametrize("on_error", ["warn", "stop"])
def test_a_checkpoint_into_a_full_disk_keeps_latest_and_follows_on_error(full_disk, tmp_path, on_error):
    mount, fill = full_disk
    ckpt = mount / "ckpt"
    args = [CLI, *TRAIN, "--out", str(tmp_path / "out"), "--set", f"checkpoint.dir={ckpt}",
            "--set", "checkpoint.every=5", "--set", f"checkpoint.on_error={on_error}"]
    horovodrun([*args, "--set", "train.max_steps=5"], controller="gloo", timeout=200)
    fill()  # the disk is full from here on: the next save (step 10) fails on rank 0
    res = horovodrun([*args, "--set", "train.max_steps=12", "--resume", "auto"], controller="gloo", timeout=200,
                     check=False)
    text = untag(res.stdout)
    assert "could not write checkpoint step_00000010" in text and "No space left on device" in text, text[-3000:]
    assert "the last good one, step_00000005, is still `latest`" in text, text[-3000:]
    if on_error == "warn":  # trains on to the end, warning at each failed save (10, 12)
        assert res.returncode == 0 and text.count("training goes on (checkpoint.on_error=warn)") == 2, text[-3000:]
    else:  # every rank stops at step 10, with one line each and no traceback
        ranks = "\n".join(line for line in res.stdout.splitlines() if line.startswith(("[0]", "[1]")))
        assert res.returncode != 0 and "Traceback" not in ranks, text[-3000:]
        assert text.count("free space or set checkpoint.on_error=warn") == 2, text[-3000:]
    assert (ckpt / "latest").read_text() == "step_00000005"
    assert load_checkpoint(ckpt / "step_00000005")["step"] == 5
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_00000005"]  # no temp folder left


@pytest.mark.parametrize("controller, transport", [("gloo", "horovod"), ("mpi", "horovod"), ("gloo", "gloo")])
def test_a_rank_that_dies_ends_the_job_with_one_line_naming_it(controller, transport, tmp_path):
    # transport=gloo: the survivor waits in torch's Gloo, not in Horovod, and says the same.
    cmd = [CLI, "launch", "--no-preflight", "--hosts", "localhost:2", "--controller", controller, "--",
           str(BIN / "python"), str(HERE / "scripts" / "slow_train.py"), "0", *TRAIN, "--out", str(tmp_path / "run"),
           "--set", f"comm.transport={transport}"]
    res = run(cmd, check=False, timeout=180, env=env(EXIT_AT="5"))
    assert res.returncode != 0 and "Traceback" not in res.stdout, res.stdout[-3000:]
    assert ("hvdtrain: launch: rank 1 exited first with code 3, and the other ranks were stopped; its lines above "
            "(tagged with its rank) say why. Fix that and rerun with --resume auto") in res.stdout, res.stdout[-3000:]
    if controller == "gloo":  # the survivor learns of it (Open MPI's mpirun stops it first)
        assert "hvdtrain: rank 0: error: another rank exited or lost its connection" in res.stdout, res.stdout[-3000:]
