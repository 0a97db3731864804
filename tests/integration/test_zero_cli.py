"""ZeRO through the CLI: a sharded checkpoint written by two ranks resumes on one (re-sharded)."""

import torch
from launch import BIN, horovodrun, run

from hvdtrain.checkpoint import load_checkpoint
from hvdtrain.zero_state import consolidate

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
