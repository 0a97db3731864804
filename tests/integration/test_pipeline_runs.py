"""Pipeline stages for real: tests/distributed/test_pipeline.py under horovodrun --mpi at 2 ranks
(S=2 x D=1) and 4 ranks (S=2 x D=2), and the CLI's pylm run cut in two, checkpointed and resumed."""

import re

import pytest
from launch import BIN, env, horovodrun

from hvdtrain.checkpoint import load_checkpoint

CLI = str(BIN / "hvdtrain")


@pytest.mark.parametrize("np", [2, 4])
def test_pipeline_equivalence_tests_pass(np):
    out = horovodrun(["python", "-m", "pytest", "tests/distributed/test_pipeline.py", "-q", "-p", "no:cacheprovider",
                      "-o", "timeout=120", "--color=no"], np=np, controller="mpi", timeout=300,
                     env=env(HVDTRAIN_TEST_GROUPS="1")).stdout
    summaries = dict(re.findall(r"\[(?:\d+,)?(\d+)\]<stdout>:([^\[\n]* passed[^\[\n]* in [\d.]+s)", out))
    assert sorted(summaries) == [str(r) for r in range(np)], out[-3000:]
    assert all("failed" not in s and "error" not in s and "14 passed" in s for s in summaries.values()), out[-3000:]


PYLM = ["--task", "pylm", "--set", "model.preset=tiny", "--set", "data.max_bytes=60000", "--set", "log.progress=false",
        "--set", "parallel.pipeline_stages=2", "--set", "train.on_oom=stop", "--set", "train.accumulation=4"]


def test_cli_pylm_pipeline_checkpoint_resumes(tmp_path):
    out = tmp_path / "run"
    first = horovodrun([CLI, "train", *PYLM, "--out", str(out), "--set", "train.max_steps=3"], controller="mpi",
                       timeout=180).stdout
    assert "pipeline: 2 stages x 1 replicas" in first and "done: step 3" in first
    ckpts = out / "checkpoints"
    state = load_checkpoint(ckpts / (ckpts / "latest").read_text())
    stages = [r["stage"] for r in state["ranks"]]
    assert [s["stage"] for s in stages] == [0, 1] and all("model" in s for s in stages)
    # Each stage saved its own layers, named by their index in the whole model.
    first_keys, last_keys = (set(s["model"]) for s in stages)
    assert any(k.startswith("layers.0.") for k in first_keys) and not first_keys & last_keys
    again = horovodrun([CLI, "train", *PYLM, "--out", str(out), "--resume", "--set", "train.max_steps=5"],
                       controller="mpi", timeout=180).stdout
    assert "resumed from" in again and "done: step 5" in again


def test_cli_refuses_pipeline_stages_under_gloo(tmp_path):
    res = horovodrun([CLI, "train", *PYLM, "--out", str(tmp_path / "g"), "--set", "train.max_steps=1"],
                     controller="gloo", timeout=120, check=False)
    assert res.returncode != 0
    assert "parallel.pipeline_stages=2 needs Horovod's MPI controller" in res.stdout + (res.stderr or "")


def test_bench_pipeline_measures_memory_that_matches_the_schedule():
    import json

    out = horovodrun([CLI, "bench", "pipeline", "--task", "pylm", "--set", "model.preset=tiny", "--set",
                      "data.max_bytes=60000", "--set", "train.batch_size=4", "--variants", "1x2,2x2,2x4",
                      "--steps", "2", "--warmup", "1", "--rounds", "1"], controller="mpi", timeout=180).stdout
    records = {r["variant"]: r for r in (json.loads(line.split("<stdout>:", 1)[1]) for line in out.splitlines()
                                         if '"bench": "pipeline"' in line)}
    assert sorted(records) == ["1x2", "2x2", "2x4"]
    one, two = records["1x2"], records["2x4"]
    assert one["param_bytes_max"] == one["param_bytes_formula"] and one["idle_share_max"] == 0.0
    # Half the weights per stage, plus the tied embedding the last stage holds too.
    assert two["param_bytes_formula"] < two["param_bytes_max"] < one["param_bytes_max"]
    # 1F1B: stage 0 keeps two micro-batches' activations alive, stage 1 one; measured = formula.
    for r in records.values():
        assert r["activation_bytes_by_rank"] == r["activation_bytes_formula_by_rank"], r
    assert 0 < two["idle_share_max"] < 1 and two["bubble_formula"] == 0.2
