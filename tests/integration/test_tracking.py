"""MLflow tracking (log.mlflow, hvdtrain/tracking.py) for real: a 2-rank run logged into a local
SQLite store, read back through MLflow's own client."""

import json

import pytest
from launch import BIN, ROOT, env, horovodrun, rank_tails, run

from hvdtrain.checkpoint import load_checkpoint

mlflow = pytest.importorskip("mlflow")
CLI = str(BIN / "hvdtrain")
DIGITS = str(ROOT / "configs" / "digits.yaml")


def test_a_two_rank_run_is_one_mlflow_run_with_params_metrics_and_artifacts(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    out = tmp_path / "run"
    # MLflow keeps a SQLite store's artifacts in ./mlruns: run where the test may write.
    horovodrun([CLI, "train", "--config", DIGITS, "--out", str(out), "--set", "train.epochs=2",
                "--set", "log.progress=false", "--set", "log.mlflow=true", "--set", "log.mlflow_experiment=digits"],
               controller="gloo", env=env(MLFLOW_TRACKING_URI=uri), timeout=240, cwd=tmp_path)
    client = mlflow.MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("digits").experiment_id])
    assert len(runs) == 1, "only rank 0 logs"
    got = runs[0]
    assert got.info.status == "FINISHED"
    assert got.data.params["task"] == "digits" and got.data.params["train.epochs"] == "2"
    assert got.data.params["log.mlflow"] == "True" and got.data.params["optim.lr"]  # the resolved config
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for kind, key in (("train", "loss"), ("train", "comm_wait_ms"), ("eval", "accuracy")):
        logged = [(r["step"], r[key]) for r in records if r["kind"] == kind]
        history = client.get_metric_history(got.info.run_id, f"{kind}/{key}")
        assert sorted((m.step, m.value) for m in history) == logged and logged, (kind, key)
    folder = mlflow.artifacts.download_artifacts(run_id=got.info.run_id, tracking_uri=uri, dst_path=str(tmp_path / "a"))
    state = load_checkpoint(f"{folder}/checkpoint")
    assert state["step"] == records[-1]["step"] == 2 * (1617 // 64)
    summary = (tmp_path / "a" / "report" / "summary.md").read_text()
    assert "(task digits)" in summary and (tmp_path / "a" / "report" / "loss.png").is_file()


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_a_tracking_store_that_fails_stops_every_rank_in_one_line(tmp_path, controller):
    (tmp_path / "a-file").write_text("")  # the store's folder is a file: no database can be made there
    res = horovodrun([CLI, "train", "--config", DIGITS, "--set", "log.progress=false",
                      "--set", "log.mlflow=true", "--set", "train.max_steps=3"], controller=controller,
                     env=env(MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path}/a-file/m.db"), timeout=120,
                     check=False, cwd=tmp_path)
    lines = [line for line in res.stdout.splitlines() if "hvdtrain: error: log.mlflow=true: MLflow could not" in line]
    assert res.returncode != 0 and len(lines) == 2, rank_tails(res.stdout, 30)  # each rank, none left waiting


def test_without_mlflow_installed_the_setting_is_refused_in_one_line(tmp_path):
    fake = tmp_path / "fake" / "mlflow"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('No module named mlflow')\n")
    res = run([CLI, "train", "--config", DIGITS, "--set", "log.mlflow=true", "--set",
               "log.progress=false", "--set", "train.max_steps=2"], check=False, timeout=120,
              env=env(PYTHONPATH=str(tmp_path / "fake")), cwd=tmp_path)
    assert res.returncode == 2 and res.stdout.strip().splitlines()[-1] == (
        "hvdtrain: error: log.mlflow=true needs MLflow: pip install 'hvdtrain[mlflow]' (or mlflow-skinny with "
        "sqlalchemy and alembic)"), res.stdout
