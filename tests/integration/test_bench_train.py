"""`hvdtrain bench train`: three ways to train the same model, launched by one command."""

import json
import math

from launch import BIN, run
from PIL import Image

CLI = str(BIN / "hvdtrain")


def test_bench_train_runs_the_three_ways_on_the_same_steps(tmp_path):
    res = run([CLI, "bench", "train", "--tasks", "digits", "--set", "model.width=4", "--np", "2",
               "--controllers", "gloo", "--steps", "2", "--warmup", "1", "--repeats", "1",
               "--plot", str(tmp_path)], timeout=240)
    recs = [json.loads(line) for line in res.stdout.splitlines() if line.startswith('{"bench"')]
    runs = [r for r in recs if r["bench"] == "train-run"]
    assert [(r["mode"], r["controller"]) for r in runs] == [("hvdtrain", "gloo"), ("horovod", "gloo"), ("ddp", "torch")]
    assert {r["backend"] for r in runs} == {"gloo"} and all(r["threads"] == 1 for r in runs)
    assert all(r["np"] == 2 and r["global_batch"] == 2 * r["batch_per_rank"] and r["steps"] == 2 for r in runs)
    assert len({r["params"] for r in runs}) == 1
    # CPU per step of each rank, all its threads: positive, one per rank, bounded by the step's wall
    # time times the threads that could run (a rank's compute thread plus its communication threads).
    assert all(len(r["rank_cpu_s"]) == 2 and all(0 < c < 10 * r["step_max_s"] for c in r["rank_cpu_s"]) for r in runs)
    assert all(len(r["rank_minor_faults"]) == 2 and all(f >= 0 for f in r["rank_minor_faults"]) for r in runs)
    # Same weights, batches and optimizer: all three ways reach the same loss (up to summation order).
    assert all(math.isclose(r["last_loss"], runs[0]["last_loss"], rel_tol=1e-4) for r in runs)
    summary = {r["mode"]: r for r in recs if r["bench"] == "train"}
    assert set(summary) == {"hvdtrain", "horovod", "ddp"}
    for r in summary.values():
        assert r["step_min_s"] <= r["step_s"] <= r["step_max_s"] and r["repeats"] == 1
        run_of_mode = next(x for x in runs if x["mode"] == r["mode"])
        assert math.isclose(r["cpu_per_rank_step_s"], sum(run_of_mode["rank_cpu_s"]) / 2)
    hv = summary["hvdtrain"]
    assert math.isclose(hv["vs_horovod"], hv["step_s"] / summary["horovod"]["step_s"])
    assert math.isclose(hv["vs_ddp"], hv["step_s"] / summary["ddp"]["step_s"])
    assert "vs_horovod" not in summary["horovod"] and "vs_ddp" in summary["horovod"]
    for name in ("step_times.png", "scaling.png"):
        with Image.open(tmp_path / name) as img:
            img.verify()
    text = (tmp_path / "summary.md").read_text()
    assert "| digits | 2 | hvdtrain/gloo |" in text and "| CPU ms per rank-step |" in text


def test_bench_train_rejects_an_unknown_mode():
    res = run([CLI, "bench", "train", "--modes", "fast"], check=False, timeout=60)
    assert res.returncode == 2
    assert res.stdout.strip() == "hvdtrain: error: --modes 'fast' is not allowed; choose from hvdtrain, horovod, ddp"
