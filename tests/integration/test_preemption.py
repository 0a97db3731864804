"""Graceful stop on signals (hvdtrain/stop.py, hvdtrain/tools/relay.py): a stop signal on one rank,
or to the launcher, stops every rank at the same step after one checkpoint, with exit code 99
(EXIT_STOPPED); `--resume auto` then ends at the weights of a run that was never stopped. A second
signal, or train.stop_grace, ends a rank at once."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from launch import BIN, ROOT, env, rank_tails, wait_for_step
from launch import finish as launch_finish

from hvdtrain.checkpoint import load_checkpoint
from hvdtrain.stop import EXIT_STOPPED

SCRIPT = str(ROOT / "tests" / "integration" / "scripts" / "slow_train.py")
STEPS = 240
TRAIN = ["train", "--config", "configs/digits.yaml", "--set", "train.batch_size=8", "--set", "train.epochs=50",
         "--set", f"train.max_steps={STEPS}", "--set", "log.every=1", "--set", "log.progress=false",
         # no checkpoint but the stop's and the last
         "--set", "log.tensorboard=false", "--set", "checkpoint.every=100000"]


def launch(controller: str, out, *extra: str) -> subprocess.Popen:
    cmd = [str(BIN / "hvdtrain"), "launch", "--no-preflight", "--hosts", "localhost:2", "--controller", controller,
           "--", str(BIN / "python"), SCRIPT, "0.01", *TRAIN, "--out", str(out), *extra]
    return subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str]:
    out, _ = launch_finish(proc, timeout)
    return proc.returncode, out


def rank_pids(out) -> dict[int, int]:
    return {int(r): int(p) for r, p in re.findall(r"whoami rank=(\d+) pid=(\d+)", out)}


def final_model(out, step: int) -> dict[str, torch.Tensor]:
    return load_checkpoint(out / "checkpoints" / f"step_{step:08d}")["model"]


@pytest.fixture(scope="module", params=["gloo", "mpi"])
def reference(request, tmp_path_factory):
    """The run that is never stopped: its final weights, per controller."""
    out = tmp_path_factory.mktemp(f"reference-{request.param}")
    rc, text = finish(launch(request.param, out))
    assert rc == 0, rank_tails(text)
    return {"controller": request.param, "model": final_model(out, STEPS)}


def find_pid(proc: subprocess.Popen, rank: int, lines: list[str]) -> int:
    """Read the launcher's output until rank `rank` has said its pid."""
    while True:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError("no pid line:\n" + "".join(lines[-40:]))
        lines.append(line)
        pids = rank_pids(line)
        if rank in pids:
            return pids[rank]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_stop_signal_to_one_rank_stops_both_at_one_step_and_resume_is_exact(reference, tmp_path):
    controller = reference["controller"]
    out = tmp_path / "run"
    proc = launch(controller, out)
    lines: list[str] = []
    pid = find_pid(proc, 1, lines)
    wait_for_step(out, 20, proc)
    os.kill(pid, signal.SIGUSR1)  # rank 1 only
    rc, rest = finish(proc)
    text = "".join(lines) + rest
    assert rc == EXIT_STOPPED, rank_tails(text)
    stops = re.findall(r"hvdtrain: rank (\d): stopped at step (\d+)", text)
    assert sorted(r for r, _ in stops) == ["0", "1"] and len({s for _, s in stops}) == 1, rank_tails(text)
    step = int(stops[0][1])
    assert 20 <= step < STEPS
    assert [p.name for p in (out / "checkpoints").glob("step_*")] == [f"step_{step:08d}"]  # the stop's only
    # Requeued: the same command with --resume auto ends where the never-stopped run did, bitwise.
    rc, text = finish(launch(controller, out, "--resume", "auto"))
    assert rc == 0 and f"resumed from {out / 'checkpoints' / f'step_{step:08d}'}" in text, rank_tails(text)
    model = final_model(out, STEPS)
    assert all(torch.equal(model[k], v) for k, v in reference["model"].items())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigterm_to_the_launcher_stops_the_ranks_gracefully(tmp_path):
    out = tmp_path / "run"
    proc = launch("gloo", out)
    wait_for_step(out, 20, proc)
    os.kill(proc.pid, signal.SIGTERM)  # the launcher alone, as `kill` or scancel --signal would
    rc, text = finish(proc)
    assert rc == EXIT_STOPPED, rank_tails(text)
    assert "hvdtrain: launch: SIGTERM: sent to 2 rank process(es)" in text
    (ckpt,) = (out / "checkpoints").glob("step_*")
    assert load_checkpoint(ckpt)["step"] == int(ckpt.name.split("_")[1])


STOP_ONLY = """import sys, time
from hvdtrain.stop import StopSignals
stop = StopSignals("SIGUSR1", float(sys.argv[1]), rank=0)
print("ready", flush=True)
time.sleep(30)  # a step that never ends: only the second signal or the deadline can end it
"""


@pytest.mark.parametrize("how", ["second signal", "deadline"])
def test_a_second_signal_or_the_grace_deadline_ends_the_rank_at_once(how):
    grace = "0.5" if how == "deadline" else "60"
    proc = subprocess.Popen([sys.executable, "-c", STOP_ONLY, grace], env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    t0 = time.monotonic()
    proc.send_signal(signal.SIGUSR1)
    if how == "second signal":
        time.sleep(0.2)
        proc.send_signal(signal.SIGUSR1)
    rc = proc.wait(timeout=10)
    err = proc.stderr.read()
    assert rc == EXIT_STOPPED and time.monotonic() - t0 < 5, err
    assert ("a second stop signal (SIGUSR1)" if how == "second signal" else "train.stop_grace=0.5 s passed") in err


SLURM_CONFIG = """task: digits
train: {epochs: 400, batch_size: 32, max_steps: 4000}
optim: {name: sgd, lr: 0.05, momentum: 0.9}
log: {every: 1, progress: false, tensorboard: false}
checkpoint: {every: 100000}
"""


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_slurm_script_stops_on_its_signal_and_requeues_the_job(tmp_path):
    # examples/slurm.sbatch as Slurm runs it: bash in the submit folder with the job's variables, on
    # one "node" (this host, 2 ranks); `scontrol` is a stand-in that records the requeue.
    submit = tmp_path / "submit"
    (submit / "configs").mkdir(parents=True)
    (submit / ".venv").symlink_to(BIN.parent)
    (submit / "configs" / "digits.yaml").write_text(SLURM_CONFIG)
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path}/scontrol.log\n")
    (stub / "scontrol").chmod(0o755)
    slurm = {"SLURM_SUBMIT_DIR": str(submit), "SLURM_JOB_NAME": "digits", "SLURM_JOB_ID": "4242",
             "SLURM_JOB_NODELIST": "localhost", "SLURM_TASKS_PER_NODE": "2", "SLURM_CPUS_PER_TASK": "1",
             "HVDTRAIN_NIC": "lo", "PATH": f"{stub}:{env()['PATH']}"}
    script = str(ROOT / "examples" / "slurm.sbatch")
    proc = subprocess.Popen(["bash", script], env=env(**slurm), cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    out = submit / "runs" / "digits-4242"
    wait_for_step(out, 50, proc)
    os.kill(proc.pid, signal.SIGUSR1)  # --signal=B:USR1@90: the batch shell alone
    rc, text = finish(proc)
    assert rc == 0 and "requeueing job 4242" in text, rank_tails(text)
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"
    (ckpt,) = (out / "checkpoints").glob("step_*")
    step = load_checkpoint(ckpt)["step"]
    assert 50 <= step < 4000
    # The requeued job: the same script, the same job id, resumes from that checkpoint.
    proc = subprocess.Popen(["bash", script], env=env(**slurm), cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    wait_for_step(out, step + 20, proc)
    os.kill(proc.pid, signal.SIGTERM)  # a preemption this time
    rc, text = finish(proc)
    resumed = f"resumed from runs/digits-4242/checkpoints/{ckpt.name}"  # relative to the submit folder
    assert rc == 0 and resumed in text and "requeueing job 4242" in text, rank_tails(text)
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n" * 2
