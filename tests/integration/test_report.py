"""`hvdtrain report RUN_DIR` on a real (short, one-process) training run."""

from launch import BIN, run
from PIL import Image

CLI = str(BIN / "hvdtrain")


def test_report_plots_a_real_run_and_names_its_config(tmp_path):
    out = tmp_path / "run"
    run([CLI, "train", "--task", "digits", "--out", str(out), "--set", "train.max_steps=6", "--set", "log.every=2",
         "--set", "train.eval_every=3", "--set", "model.width=4", "--set", "log.progress=false"], timeout=120)
    res = run([CLI, "report", str(out)], timeout=120)
    report = out / "report"
    for name in ("loss", "accuracy", "throughput", "lr"):
        with Image.open(report / f"{name}.png") as img:
            assert img.format == "PNG" and img.size[0] > 100 and img.size[1] > 100
            img.verify()
    assert not (report / "gns.png").exists()  # digits logs no gradient noise scale: skipped, not faked
    md = (report / "summary.md").read_text()
    assert "(task digits)" in md and "max_steps: 6" in md and "width: 4" in md
    assert "| last step | 6 |" in md and "Gradient noise scale" in md.split("Skipped")[1]
    assert "max_steps: 6" in (report / "summary.html").read_text()
    assert f"({len(list(report.glob('*.png')))} plots; skipped: " in res.stdout


def test_report_plots_what_an_adaptive_profiled_run_logged(tmp_path):
    from hvdtrain.tools.report import load, series

    out = tmp_path / "run"
    run([CLI, "train", "--task", "digits", "--out", str(out), "--set", "train.epochs=2", "--set", "log.every=5",
         "--set", "adaptive.enabled=true", "--set", "adaptive.warmup_steps=20", "--set", "adaptive.decide_every=10",
         "--set", "memory.profile=true", "--set", "log.progress=false"], timeout=180)
    res = run([CLI, "report", str(out)], timeout=120)
    assert res.stdout.strip().endswith("(8 plots; skipped: none)"), res.stdout
    for name in ("batch_size", "gns", "memory", "comm"):
        with Image.open(out / "report" / f"{name}.png") as img:
            img.verify()
    records = load(out)
    data = series(records)
    adaptive = [r for r in records if r["kind"] == "adaptive"]
    assert data[("adaptive", "B")] == ([r["step"] for r in adaptive], [float(r["B"]) for r in adaptive])
    assert len(data[("adaptive", "gns")][1]) > 0  # finite estimates only (NaN before the first)
    assert data[("memory", "peak")][1] and all(v > 0 for v in data[("memory", "peak")][1])
    waits = data[("train", "comm_wait_ms")][1]
    assert len(waits) == len([r for r in records if r["kind"] == "train"]) and all(w >= 0 for w in waits)
    assert "Skipped (the run logged no such field): none" in (out / "report" / "summary.md").read_text()


def test_report_on_a_folder_without_metrics_is_one_line_exit_2(tmp_path):
    res = run([CLI, "report", str(tmp_path)], check=False, timeout=60)
    assert res.returncode == 2
    assert res.stdout.strip() == f"hvdtrain: error: {tmp_path}/metrics.jsonl does not exist; pass the folder " \
        "given to `hvdtrain train --out` (log.dir)"
