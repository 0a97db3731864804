"""ZeRO through the CLI: a sharded checkpoint written by two ranks resumes on one (re-sharded)."""

import json

import torch
from launch import BIN, horovodrun, run

from hvdtrain.checkpoint import load_checkpoint
from hvdtrain.comm.zero_state import consolidate

CLI = str(BIN / "hvdtrain")
COMMON = ["--task", "digits", "--set", "optim.name=adam", "--set", "optim.lr=0.001", "--set", "log.progress=false",
          "--set", "comm.bucket_mb=0.05"]


def test_two_rank_zero2_checkpoint_resumes_on_one_rank(tmp_path):
    out = tmp_path / "run"
    horovodrun([CLI, "train", *COMMON, "--out", str(out), "--set", "memory.zero_stage=2",
                "--set", "train.max_steps=4"], controller="gloo", timeout=180)
    ckpts = out / "checkpoints"
    state = load_checkpoint(ckpts / (ckpts / "latest").read_text())
    shards = [r["reducer"] for r in state["ranks"]]
    assert [s["zero"]["rank"] for s in shards] == [0, 1] and shards[0]["zero"]["world_size"] == 2
    sizes = [[v["exp_avg"].numel() for _, v in sorted(s["optimizer"]["state"].items())] for s in shards]
    assert sizes[0] == sizes[1] and len(sizes[0]) > 1  # equal shards of several buckets
    full, _ = consolidate(shards)
    assert set(full) == {k for k in state["model"] if "weight" in k or "bias" in k}
    # One rank, the same global batch (64): the two shards are re-sharded into one.
    again = run([CLI, "train", *COMMON, "--out", str(out), "--resume", "--set", "memory.zero_stage=1",
                 "--set", "train.batch_size=64", "--set", "train.max_steps=6"], timeout=120).stdout
    assert "resumed from" in again and "done: step 6" in again
    resumed = load_checkpoint(ckpts / (ckpts / "latest").read_text())
    mine = resumed["ranks"][0]["reducer"]
    assert mine["zero"]["world_size"] == 1
    assert int(mine["optimizer"]["state"][0]["step"]) == 6  # Adam's count continued from 4
    assert torch.isfinite(torch.cat([p.reshape(-1) for p in resumed["model"].values()])).all()
    # Without ZeRO the sharded optimizer state cannot be used: one clear line, exit 2.
    refused = run([CLI, "train", *COMMON, "--out", str(out), "--resume", "--set", "train.batch_size=64",
                   "--set", "train.max_steps=8"], timeout=120, check=False, split=True)
    assert refused.returncode == 2
    assert "holds ZeRO-sharded optimizer state; resume it with memory.zero_stage=1, 2 or 3" in refused.stderr


def test_two_rank_zero3_checkpoint_reshards_to_one_rank(tmp_path):
    # pylm: no batch norm, so one rank's step over the global batch equals two ranks' averaged steps.
    stage3 = ["--task", "pylm", "--set", "model.preset=tiny", "--set", "data.max_bytes=60000", "--set",
              "optim.name=adam", "--set", "optim.lr=0.001", "--set", "optim.lr_scaling=none", "--set",
              "log.progress=false", "--set", "memory.zero_stage=3"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    for out, steps in ((whole, 6), (cut, 4)):
        horovodrun([CLI, "train", *stage3, "--set", "train.batch_size=8", "--out", str(out), "--set",
                    f"train.max_steps={steps}"], controller="mpi", timeout=180)
    ckpts = cut / "checkpoints"
    saved = load_checkpoint(ckpts / (ckpts / "latest").read_text())
    assert [r["reducer"]["zero"]["stage"] for r in saved["ranks"]] == [3, 3]
    # Steps 5 and 6 on one rank at the same global batch (16), from the two shards re-cut into one.
    again = run([CLI, "train", *stage3, "--out", str(cut), "--resume", "--set", "train.batch_size=16",
                 "--set", "train.max_steps=6"], timeout=120).stdout
    assert "resumed from" in again and "done: step 6" in again
    resumed = load_checkpoint(ckpts / (ckpts / "latest").read_text())
    assert resumed["ranks"][0]["reducer"]["zero"]["world_size"] == 1
    reference = load_checkpoint(whole / "checkpoints" / (whole / "checkpoints" / "latest").read_text())
    for key, value in reference["model"].items():
        # One rank's mean over 16 samples against the average of two ranks' means over 8.
        torch.testing.assert_close(resumed["model"][key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_plan_measure_matches_prediction_on_one_rank():
    out = run([CLI, "plan", "--task", "pylm", "--set", "model.preset=tiny", "--set", "data.max_bytes=100000",
               "--optimizer", "adam", "--zero-stage", "0,2", "--measure", "--steps", "2"], timeout=120).stdout
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [r["zero_stage"] for r in records] == [0, 2]
    for r in records:
        psi, m = r["params"], r["measured"]
        assert m["params"] == r["memory"]["params"] == 4 * psi and m["grads"] == 4 * psi  # one rank: no sharding
        assert 0 <= m["optimizer"] - 8 * psi <= 4 * 100  # Adam's moments plus one step counter per tensor
        assert m["peak_rss"] > m["total"] and set(m["comm_s"]) >= {"total"}
