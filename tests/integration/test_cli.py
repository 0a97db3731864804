"""The `hvdtrain` command: built-in tasks under horovodrun, resume, print-config, eval, export and bad
input."""

import json
import re
from pathlib import Path

import pytest
import torch
from launch import BIN, env, horovodrun, run, untag

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


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("digits")
    run([CLI, "train", "--config", "configs/digits.yaml", "--out", str(out), "--set", "train.epochs=2",
         "--set", "log.progress=false", "--set", "log.tensorboard=false"], timeout=180)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return out, [r for r in records if r["kind"] == "eval"][-1]


def test_eval_gives_the_runs_held_out_metrics_at_any_number_of_ranks(digits_run):
    out, trained = digits_run
    one = json.loads(run([CLI, "eval", "--checkpoint", str(out / "checkpoints"), "--json"]).stdout)
    two = json.loads(untag(horovodrun([CLI, "eval", "--checkpoint", str(out / "checkpoints"), "--json", "--set",
                                       "data.num_workers=2"], controller="mpi").stdout).strip().splitlines()[-1])
    assert one["step"] == two["step"] == trained["step"] and (one["ranks"], two["ranks"]) == (1, 2)
    assert one["samples"] == two["samples"] == 179
    for got in (one, two):  # 2 ranks: the same sums, added in another order
        assert got["loss"] == pytest.approx(trained["loss"], rel=1e-6)
        assert got["accuracy"] == pytest.approx(trained["accuracy"], rel=1e-9)


def test_export_writes_a_plain_state_dict_the_tasks_model_loads(digits_run, tmp_path):
    from hvdtrain.config import Config, from_dict
    from hvdtrain.tasks import build_task

    out, _ = digits_run
    saved = load_checkpoint(out / "checkpoints" / (out / "checkpoints" / "latest").read_text())
    for dtype, torch_dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        target = tmp_path / f"model-{dtype}.pt"
        text = run([CLI, "export", "--checkpoint", str(out / "checkpoints"), "--out", str(target), "--dtype",
                    dtype]).stdout
        assert text.startswith(f"exported {out}/checkpoints/step_") and str(target) in text
        exported = torch.load(target, weights_only=True)
        assert exported["step"] == saved["step"] and exported["task"] == "digits"
        model = build_task(from_dict(Config, exported["config"])).model
        model.load_state_dict(exported["state_dict"])  # a plain state_dict of the task's model
        for name, tensor in exported["state_dict"].items():
            assert tensor.dtype == torch_dtype
            assert torch.equal(tensor, saved["model"][name].to(torch_dtype)), name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model-bf16.pt", "model-fp32.pt"]  # no temp file


@pytest.mark.parametrize("args, message", [
    (["eval", "--checkpoint", "{tmp}/nope"], "checkpoint {tmp}/nope does not exist; give a step_N folder"),
    (["eval", "--checkpoint", "{run}/checkpoints", "--set", "model.width=8"],
     "--set model.width: the checkpoint's weights were trained with its own model.width"),
    (["eval", "--checkpoint", "{run}/checkpoints", "--set", "data.num_workers=-1"], "data.num_workers=-1 must be >= 0"),
    (["export", "--checkpoint", "{run}/checkpoints", "--out", "{tmp}"], "--out {tmp} is a folder"),
    (["export", "--checkpoint", "{run}/checkpoints", "--out", "{tmp}/no/model.pt"],
     "--out {tmp}/no/model.pt: folder {tmp}/no does not exist"),
])
def test_eval_and_export_refuse_bad_input_in_one_line(digits_run, tmp_path, args, message):
    out, _ = digits_run
    args = [a.format(tmp=tmp_path, run=out) for a in args]
    res = run([CLI, *args], check=False, timeout=120)
    assert res.returncode == 2, res.stdout
    assert res.stdout.strip().startswith(f"hvdtrain: error: {message.format(tmp=tmp_path, run=out)}"), res.stdout
    assert len(res.stdout.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []
