"""The `hvdtrain` command: built-in tasks under horovodrun, resume, print-config and bad input."""

import re
from pathlib import Path

import pytest
import torch
from launch import BIN, env, horovodrun, run

from hvdtrain.checkpoint import load_checkpoint

CLI = str(BIN / "hvdtrain")


def final_accuracy(output: str) -> float:
    m = re.search(r"done: step \d+, eval loss [\d.]+ accuracy ([\d.]+)", output)
    assert m, output[-2000:]
    return float(m.group(1))


def test_digits_two_ranks_reaches_95_percent_then_resumes(tmp_path):
    out = tmp_path / "run"
    first = horovodrun([CLI, "train", "--config", "configs/digits.yaml", "--out", str(out),
                        "--set", "train.epochs=8", "--set", "log.progress=false"], controller="gloo").stdout
    assert final_accuracy(first) >= 0.95
    assert re.search(r"epoch 8/8 step \d+: train loss", first)
    state = load_checkpoint(out / "checkpoints" / (out / "checkpoints" / "latest").read_text())
    assert state["step"] == 8 * (1617 // 64) and state["config"]["task"] == "digits"
    assert (out / "metrics.jsonl").is_file() and list((out / "tb").iterdir())
    again = horovodrun([CLI, "train", "--config", "configs/digits.yaml", "--out", str(out), "--resume",
                        "--set", "train.epochs=9", "--set", "log.progress=false"], controller="mpi").stdout
    assert f"resumed from {out}/checkpoints/step_{state['step']:08d}" in again
    assert f"done: step {9 * (1617 // 64)}" in again


@pytest.mark.parametrize("task, extra", [
    ("pylm", ["data.max_bytes=300000", "model.block_size=32"]),
    ("synthetic", ["data.synthetic_samples=128", "model.width=8", "train.batch_size=16"]),
])
def test_other_tasks_run_without_a_launcher(task, extra, tmp_path):
    sets = [a for kv in ["train.max_steps=3", "log.progress=false", *extra] for a in ("--set", kv)]
    out = run([CLI, "train", "--task", task, "--out", str(tmp_path), *sets], timeout=180).stdout
    assert "hvdtrain: 1 rank(s)" in out and "done: step 3" in out
    assert (tmp_path / "checkpoints" / "step_00000003" / "state.pt").is_file()


def test_print_config_shows_resolved_values(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('task = "pylm"\n[train]\nepochs = 4\n')
    out = run([CLI, "print-config", "--config", str(cfg), "--set", "model.preset=small"]).stdout
    assert "task: pylm" in out and "epochs: 4" in out and "n_embd: 384" in out


def _fake_horovod_without_torch(folder: Path) -> str:
    # Reproduces what a Horovod built without HOROVOD_WITH_PYTORCH raises on import.
    pkg = folder / "horovod" / "torch"
    pkg.mkdir(parents=True)
    (folder / "horovod" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text(
        "raise ImportError('Extension horovod.torch has not been built: /x/mpi_lib.so not found')\n")
    return str(folder)


def _checkpoint_folder(tmp_path: Path, content: object | bytes) -> Path:
    folder = tmp_path / "run" / "checkpoints" / "step_00000005"
    folder.mkdir(parents=True)
    if isinstance(content, bytes):
        (folder / "state.pt").write_bytes(content)
    else:
        torch.save(content, folder / "state.pt")
    (folder.parent / "latest").write_text(folder.name)
    return folder


class NotAllowed:  # a pickled instance of this must never be loaded
    pass


BAD = {
    "unknown task": (["--task", "imagenet"],
                     "config.task='imagenet' is not allowed; choose one of digits, mnist1d, pylm"),
    "bad value": (["--set", "train.batch_size=0"], "train.batch_size=0 must be >= 1"),
    "bad type": (["--set", "train.epochs=many"], "train.epochs='many' has type str; expected int"),
    "unknown key": (["--set", "optim.learning_rate=1"], "unknown key optim.learning_rate; allowed:"),
    "missing config file": (["--config", "/nonexistent/c.yaml"], "config file /nonexistent/c.yaml does not exist"),
    "missing data path": (["--task", "pylm", "--set", "data.path=/nonexistent/src"],
                          "data.path /nonexistent/src does not exist"),
    "no checkpoint to resume": (["--resume"], "no checkpoint in {run}/checkpoints to resume from"),
    "missing checkpoint path": (["--resume", "/nonexistent/step_1"], "checkpoint /nonexistent/step_1 does not exist"),
    "corrupt checkpoint": (["--resume"], "is corrupt or not an hvdtrain checkpoint"),
    "pickled object": (["--resume"], "is corrupt or not an hvdtrain checkpoint"),
    "incompatible checkpoint": (["--resume", "--set", "model.width=16"], "model.width (32 -> 16)"),
    "horovod without torch": ([], "Horovod's PyTorch ops are not available"),
    "dataset smaller than a batch": (["--set", "train.batch_size=4096"], "fewer than one global batch of 4096"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_one_line_nonzero_nothing_written(case, tmp_path):
    args, message = BAD[case]
    run_dir = tmp_path / "run"
    extra_env = {}
    if case == "corrupt checkpoint":
        _checkpoint_folder(tmp_path, b"PK\x03\x04 truncated zip")
    elif case == "pickled object":
        _checkpoint_folder(tmp_path, {"format": 1, "payload": NotAllowed()})
    elif case == "incompatible checkpoint":
        from hvdtrain.config import Config
        _checkpoint_folder(tmp_path, {"format": 1, "step": 5, "config": Config().to_dict(), "ranks": []})
    elif case == "horovod without torch":
        extra_env["PYTHONPATH"] = _fake_horovod_without_torch(tmp_path / "fake")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    res = run([CLI, "train", "--out", str(run_dir), "--set", "log.progress=false", *args], check=False,
              env=env(**extra_env), timeout=120)
    lines = [line for line in res.stdout.splitlines() if line.strip()]
    assert res.returncode == 2, res.stdout[-2000:]
    assert "Traceback" not in res.stdout
    assert lines[-1].startswith("hvdtrain: error: ") and message.format(run=run_dir) in lines[-1], res.stdout[-2000:]
    after = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert after == before, "a failed start must not write files"
