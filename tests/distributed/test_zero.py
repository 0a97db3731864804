"""ZeRO stages 1 and 2 against unsharded training, at any world size (and plainly, as size 1)."""

import dataclasses

import pytest
import torch
from helpers import blobs, flat_params, mlp, shared_tmpdir, small_config

import hvdtrain
from hvdtrain.comm.zero import ZeroReducer
from hvdtrain.comm.zero_state import consolidate, reshard
from hvdtrain.config import CheckpointConfig, CommConfig, MemoryConfig, OptimConfig
from hvdtrain.tasks import classification_loss

# 515 parameters (odd: every world size pads), in two buckets of 131 and 384 values.
BUCKET_MB = 0.001


def config(stage, optim="adam", compression="none", clip=0.0, **train):
    cfg = small_config(**{"epochs": 1, **train})
    lr = {"sgd": 0.05, "adam": 1e-2, "adamw": 1e-2}[optim]
    return dataclasses.replace(
        cfg, memory=MemoryConfig(zero_stage=stage),
        optim=OptimConfig(name=optim, lr=lr, momentum=0.9, weight_decay=0.1, clip_grad_norm=clip),
        comm=CommConfig(compression=compression, bucket_mb=BUCKET_MB))


def train(world, cfg, seed=0, data=None):
    model = mlp(seed=seed)
    result = hvdtrain.fit(world, model, None, data or blobs(n=96), cfg)
    return model, result


@pytest.mark.parametrize("optim, compression", [(o, c) for c in ("none", "fp16") for o in ("sgd", "adam", "adamw")]
                         + [("adam", "bf16")])
def test_zero_matches_unsharded_training(world, optim, compression):
    reference, _ = train(world, config(0, optim, compression))
    for stage in (1, 2):
        model, result = train(world, config(stage, optim, compression))
        assert result.step == reference_steps(world)
        # Same averaged gradients and elementwise updates; only the summation order of a ring with
        # 3+ ranks may differ between bucket layouts. fp16/bf16 round in both runs at the same places.
        tol = {"none": 1e-6, "fp16": 1e-4, "bf16": 1e-3}[compression]
        torch.testing.assert_close(flat_params(model), flat_params(reference), rtol=tol, atol=tol)
        if compression == "none":
            assert not torch.equal(flat_params(model), flat_params(mlp(seed=0)))  # it trained


def reference_steps(world):
    return 96 // (world.size * 8)


def test_zero_global_norm_clipping_matches_unsharded(world):
    reference, _ = train(world, config(0, "sgd", clip=0.05))
    unclipped, _ = train(world, config(0, "sgd"))
    for stage in (1, 2):
        model, _ = train(world, config(stage, "sgd", clip=0.05))
        torch.testing.assert_close(flat_params(model), flat_params(reference), rtol=1e-6, atol=1e-6)
    assert not torch.allclose(flat_params(reference), flat_params(unclipped))  # clipping was active


def test_padding_and_shard_sizes(world):
    model = mlp(seed=0)
    zero = ZeroReducer(world, model.named_parameters(), 2, bucket_mb=BUCKET_MB)
    before = {n: p.detach().clone() for n, p in mlp(seed=0).named_parameters()}
    assert [b["numel"] % world.size for b in zero.buckets] == [0] * len(zero.buckets)
    assert sum(p.numel() for p in model.parameters()) == 515
    sizes = world.allgather_object([s.numel() for s in zero.shards], name="t.zero.sizes")
    assert all(s == sizes[0] for s in sizes)
    for name, p in model.named_parameters():  # parameters are views into the buckets, values kept
        assert torch.equal(p, before[name]) and any(p.data_ptr() >= f.data_ptr() and
                                                    p.data_ptr() < f.data_ptr() + f.numel() * 4 for f in zero.flat)
    zero.remove()


def test_optimizer_state_is_sharded(world):
    model = mlp(seed=0)
    zero = ZeroReducer(world, model.named_parameters(), 1, bucket_mb=BUCKET_MB)
    optimizer = zero.shard_optimizer(torch.optim.Adam(model.parameters(), lr=1e-3))
    model(torch.zeros(2, 12)).sum().backward()
    assert zero.synchronize()
    optimizer.step()
    padded = sum(b["numel"] for b in zero.buckets)
    mem = zero.memory()
    # exp_avg and exp_avg_sq for this rank's slice, plus one step counter per bucket.
    assert mem["optimizer"] == 2 * 4 * padded // world.size + 4 * len(zero.buckets)
    assert mem["grads"] == 4 * padded and mem["params"] == 4 * padded
    zero.remove()


def test_non_finite_on_one_rank_skips_everywhere(world):
    calls = [0]

    def loss_fn(model, batch):
        loss, sums = classification_loss(model, batch)
        calls[0] += 1
        if world.rank == world.size - 1 and calls[0] == 3:
            loss = loss * float("inf")
        return loss, sums

    model = mlp(seed=3)
    result = hvdtrain.fit(world, model, None, blobs(n=96), config(2, "adam", accumulation=1), loss_fn=loss_fn)
    assert world.allgather_object(result.skipped, name="t.zero.skipped") == [1] * world.size
    final = world.allgather_object(flat_params(model), name="t.zero.final")
    assert all(torch.equal(final[0], f) for f in final) and torch.isfinite(final[0]).all()


def test_sharded_checkpoint_resumes_exactly(world):
    folder = shared_tmpdir(world)
    base = config(2, "adamw", epochs=2, shuffle=True, batch_size=2, accumulation=1)
    whole_model, whole = train(world, base, seed=1)
    stop = whole.step // 2 + 1
    ck = CheckpointConfig(dir=f"{folder}/ck", every=stop)
    first, _ = train(world, dataclasses.replace(base, train=dataclasses.replace(base.train, max_steps=stop),
                                                checkpoint=ck), seed=1)
    resumed, result = train(world, dataclasses.replace(base, checkpoint=dataclasses.replace(ck, resume="latest")),
                            seed=2)  # other initial weights: everything must come from the checkpoint
    assert result.history[0]["resumed_from"].endswith(f"step_{stop:08d}")
    if world.size <= 2:  # a two-rank sum is order-free, so the runs repeat bit for bit
        assert torch.equal(flat_params(resumed), flat_params(whole_model))
    else:
        torch.testing.assert_close(flat_params(resumed), flat_params(whole_model), rtol=1e-5, atol=1e-6)


def test_shards_reshard_to_another_world_size_by_parameter_name(world):
    model = mlp(seed=0)
    zero = ZeroReducer(world, model.named_parameters(), 1, bucket_mb=BUCKET_MB)
    optimizer = zero.shard_optimizer(torch.optim.Adam(model.parameters(), lr=1e-2))
    plain = mlp(seed=0)
    reference = torch.optim.Adam(plain.parameters(), lr=1e-2)
    x, y = blobs().tensors
    for _ in range(3):  # every rank the same batch: the average equals the plain gradient
        for m in (model, plain):
            torch.nn.functional.cross_entropy(m(x[:16]), y[:16]).backward()
        assert zero.synchronize()
        optimizer.step()
        optimizer.zero_grad()
        reference.step()
        reference.zero_grad()
    saved = world.allgather_object(zero.state_dict(), name="t.zero.saved")
    full, _ = consolidate(saved)
    for name, _ in plain.named_parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(full[name][key], reference.state[plain.get_parameter(name)][key])
    # Cut the same state for a world one larger, with another bucket size, and put it back together.
    other = ZeroReducer(world, mlp(seed=0).named_parameters(), 2, bucket_mb=1.0)
    n = world.size + 1
    parts = []
    for r in range(n):
        layout = dict(other.partition(), world_size=n, rank=r)
        layout["buckets"] = [dict(b, numel=-(-sum(_numel(s) for s in b["shapes"]) // n) * n) for b in layout["buckets"]]
        parts.append({"zero": layout, "optimizer": reshard(saved, layout), "codec": "none", "residuals": {}})
    again, _ = consolidate(parts)
    for name in full:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(again[name][key], full[name][key])
    other.remove()
    zero.remove()


def _numel(shape):
    out = 1
    for d in shape:
        out *= d
    return out
