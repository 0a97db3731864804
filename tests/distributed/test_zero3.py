"""ZeRO stage 3 (parameters sharded, gathered per unit) against unsharded training, at any world size."""

import dataclasses

import pytest
import torch
from helpers import blobs, flat_params, lm_loss, mlp, shared_tmpdir, small_config, text, tiny_gpt
from torch import nn

import hvdtrain
from hvdtrain.comm.zero3 import Zero3Reducer, sharding_units
from hvdtrain.config import CheckpointConfig, CommConfig, MemoryConfig, OptimConfig

LR = {"sgd": 0.05, "adam": 1e-2, "adamw": 1e-2}


def config(stage, optim="adam", clip=0.0, precision="fp32", checkpointing=False, units="", prefetch=1, **train):
    cfg = small_config(**{"epochs": 1, **train})
    return dataclasses.replace(
        cfg, memory=MemoryConfig(zero_stage=stage, precision=precision, activation_checkpointing=checkpointing,
                                 zero3_units=units, zero3_prefetch=prefetch),
        optim=OptimConfig(name=optim, lr=LR[optim], momentum=0.9, weight_decay=0.1, clip_grad_norm=clip))


def train(world, cfg, model, data=None, loss_fn=None):
    kwargs = {"loss_fn": loss_fn} if loss_fn else {}
    return hvdtrain.fit(world, model, None, data or blobs(n=96), cfg, **kwargs)


@pytest.mark.parametrize("optim", ["sgd", "adam", "adamw"])
@pytest.mark.parametrize("accumulation, clip", [(1, 0.0), (2, 0.05)])
def test_zero3_matches_unsharded_training(world, optim, accumulation, clip):
    reference = mlp(seed=0)
    train(world, config(0, optim, clip, accumulation=accumulation), reference)
    model = mlp(seed=0)
    result = train(world, config(3, optim, clip, accumulation=accumulation), model)
    assert result.step == 96 // (world.size * 4 * accumulation)
    # The model is whole again after fit, on every rank.
    torch.testing.assert_close(flat_params(model), flat_params(reference), rtol=1e-6, atol=1e-6)
    assert not torch.equal(flat_params(model), flat_params(mlp(seed=0)))  # it trained


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_zero3_compressed_reduce_scatter_matches_zero2(world, compression):
    # Stage 3 reduce-scatters each unit through the same codecs as stage 2 (one micro-batch a step:
    # the same rounding at the same places, though over other bucket boundaries).
    runs = {}
    for stage in (2, 3):
        model = mlp(seed=0)
        cfg = config(stage, "adam", accumulation=1)
        train(world, dataclasses.replace(cfg, comm=CommConfig(compression=compression)), model)
        runs[stage] = flat_params(model)
    tol = {"fp16": 1e-4, "bf16": 1e-3}[compression]
    torch.testing.assert_close(runs[3], runs[2], rtol=tol, atol=tol)
    assert not torch.equal(runs[3], flat_params(mlp(seed=0)))


@pytest.mark.parametrize("precision, checkpointing", [("fp32", False), ("bf16", False), ("fp32", True)])
def test_zero3_transformer_with_tied_weights_matches_unsharded(world, precision, checkpointing):
    # The GPT ties its token embedding to its output layer: that weight belongs to two units, so it
    # lives in the root unit. Activation checkpointing recomputes each block inside its gathered unit.
    # Stages 1 and 2 are run beside it, for the same pairs (bf16 autocast, checkpointing).
    # The attention's key bias cannot change the output (softmax is shift-invariant), so its gradient
    # is rounding noise, which Adam scales to full-size steps: the noise follows the summation order,
    # which differs with the flat buffer's alignment on an AVX-512 machine (1e-4 apart after 16 steps),
    # and with the per-micro-batch reduce-scatters (accumulation, tested on the MLP). The fused
    # projection's bias goes, so every compared value is a real gradient's.
    # Under bf16 autocast the sharded steps differ from the unsharded one in the last bit of fp32 (the
    # gradient norm is summed in another order), and a last-bit difference in a weight flips some of
    # its bf16 roundings in the next forward; Adam turns a flipped near-zero gradient into a step of
    # the other sign. So bf16 compares the whole update: 0.44% apart after 16 steps on an AVX-512
    # machine (elementwise up to 5e-3), where a wrong or missing gradient moves it by tens of percent.
    runs, start = {}, None
    for stage in (0, 1, 2, 3):
        model = tiny_gpt()
        for block in model.blocks:
            block.attn.qkv.register_parameter("bias", None)
        start = flat_params(model).clone()
        cfg = config(stage, "adamw", clip=1.0, precision=precision, checkpointing=checkpointing,
                     batch_size=4, accumulation=1)
        train(world, cfg, model, text(), lm_loss)
        runs[stage] = flat_params(model)
    for stage in (1, 2, 3):
        if precision == "bf16":
            update, reference = runs[stage] - start, runs[0] - start
            assert (update - reference).norm() < 0.02 * reference.norm(), (stage, (update - reference).norm())
        else:
            torch.testing.assert_close(runs[stage], runs[0], rtol=1e-6, atol=1e-6)


class Layer(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc, self.norm = nn.Linear(width, width), nn.LayerNorm(width)

    def forward(self, x):
        return self.norm(torch.relu(self.fc(x))) + x


class UserModel(nn.Module):
    """A user's own model: the sharding unit is its Layer class, wherever the layers sit."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(12, 24)
        self.body = nn.Sequential(Layer(24), nn.Dropout(0.0), Layer(24))
        self.extra = Layer(24)
        self.out = nn.Linear(24, 3)
        self.scale = nn.Parameter(torch.ones(3))  # the root's own parameter

    def forward(self, x):
        return self.out(self.extra(self.body(self.inp(x)))) * self.scale


@pytest.mark.parametrize("prefetch", [0, 2])
def test_zero3_user_model_by_class_matches_unsharded(world, prefetch):
    assert [n for n, _ in sharding_units(UserModel(), "Layer")] == ["body.0", "body.2", "extra"]
    runs = {}
    for stage in (0, 3):
        torch.manual_seed(0)
        model = UserModel()
        train(world, config(stage, "adam", units="Layer", prefetch=prefetch, accumulation=2), model)
        runs[stage] = flat_params(model)
    torch.testing.assert_close(runs[3], runs[0], rtol=1e-6, atol=1e-6)


def test_zero3_holds_a_slice_of_every_parameter(world):
    model = tiny_gpt()
    whole = sum(p.numel() for p in model.parameters())
    zero = Zero3Reducer(world, model)
    padded = sum(b["numel"] for b in zero.buckets)
    assert padded - whole < world.size * len(zero.buckets)  # padding only
    assert zero.memory()["params"] == 4 * padded // world.size  # nothing gathered between steps
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    with zero.full_parameters():
        assert zero.memory()["params"] == 4 * padded // world.size + 4 * padded
        values = world.allgather_object(flat_params(model), name="t.zero3.values")
        assert all(torch.equal(values[0], v) for v in values)  # rank 0's initial weights everywhere
        torch.testing.assert_close(values[0], flat_params(tiny_gpt()))
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    zero.unshard()
    torch.testing.assert_close(flat_params(model), flat_params(tiny_gpt()))


def test_zero3_prefetch_follows_the_recorded_order(world):
    model = UserModel()
    zero = Zero3Reducer(world, model, "Layer", prefetch=1)
    x = torch.randn(4, 12)
    for _ in range(2):
        zero.arm(True)
        model(x).sum().backward()
        assert zero.synchronize()
        zero.zero_grad()
    units, root = [0, 1, 2], 3  # body.0, body.2, extra; the root holds inp, out and scale
    assert zero._order == {"forward": units, "backward": units[::-1]} and len(zero.buckets) == root + 1
    # Each step gathers every unit twice (forward and backward) and the root once.
    assert zero.gather_count == 2 * (2 * len(units) + 1)
    zero.remove()


def test_zero3_checkpoint_resumes_exactly(world):
    folder = shared_tmpdir(world)
    base = config(3, "adamw", epochs=2, shuffle=True, batch_size=2, accumulation=1)
    whole_model = mlp(seed=1)
    whole = train(world, base, whole_model)
    stop = whole.step // 2 + 1
    ck = CheckpointConfig(dir=f"{folder}/ck", every=stop)
    train(world, dataclasses.replace(base, train=dataclasses.replace(base.train, max_steps=stop), checkpoint=ck),
          mlp(seed=1))
    resumed = mlp(seed=2)  # other initial weights: everything must come from the checkpoint
    result = train(world, dataclasses.replace(base, checkpoint=dataclasses.replace(ck, resume="latest")), resumed)
    assert result.history[0]["resumed_from"].endswith(f"step_{stop:08d}")
    if world.size <= 2:  # a two-rank sum is order-free, so the runs repeat bit for bit
        assert torch.equal(flat_params(resumed), flat_params(whole_model))
    else:
        torch.testing.assert_close(flat_params(resumed), flat_params(whole_model), rtol=1e-5, atol=1e-6)
    # The same checkpoint re-shards into ZeRO-2's layout by parameter name (and back, the same way).
    again = mlp(seed=3)
    latest = dataclasses.replace(ck, resume="latest")
    more = dataclasses.replace(base, memory=MemoryConfig(zero_stage=2), checkpoint=latest)
    train(world, more, again)  # the checkpoint is the end of training: nothing left to run
    assert torch.equal(flat_params(again), flat_params(resumed))


def test_bench_memory_compares_zero_variants(world):
    from hvdtrain.bench.memory import memory
    from hvdtrain.config import build

    cfg = build(task="pylm", overrides=["model.preset=tiny", "data.max_bytes=20000", "train.batch_size=2",
                                        "log.progress=false"])
    records = memory(world, cfg, ["fp32+z2", "fp32+z3+pf0", "fp32+z3"], steps=2, warmup=1, rounds=1)
    by = {r["variant"]: r for r in records}
    assert set(by) == {"fp32+z2", "fp32+z3+pf0", "fp32+z3"} and all(r["step_s"] > 0 for r in records)
    assert "gather_wait_s" not in by["fp32+z2"] and by["fp32+z3"]["gather_wait_s"] >= 0
    # Between steps ZeRO-3 holds only its slices of the parameters (the profiler counts them).
    if world.size > 1:
        assert by["fp32+z3"]["params_bytes"] < by["fp32+z2"]["params_bytes"]


@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_fp16_loss_scale_with_every_zero_stage_matches_unsharded(world, clip):
    # The scaled gradient is unscaled on the slices, and the global norm clipping uses with it.
    runs = {}
    for stage in (0, 1, 2, 3):
        model = mlp(seed=0)
        result = train(world, config(stage, "adam", clip, precision="fp16", accumulation=2), model)
        assert result.skipped == 0
        runs[stage] = flat_params(model)
    for stage in (1, 2, 3):
        torch.testing.assert_close(runs[stage], runs[0], rtol=1e-6, atol=1e-6)


def test_fp16_overflow_skips_on_every_rank_and_backs_off_the_scale(world):
    # A loss scale of 2^20 overflows fp16 at once: the step is skipped everywhere and the scale halves
    # until it fits; then training goes on.
    cfg = config(3, "adam", precision="fp16", epochs=2)
    cfg = dataclasses.replace(cfg, memory=dataclasses.replace(cfg.memory, loss_scale=2.0**20))
    model = mlp(seed=0)
    result = train(world, cfg, model)
    assert result.skipped > 0 and result.step > result.skipped
    assert world.allgather_object(result.skipped, name="t.zero3.fp16.skips") == [result.skipped] * world.size
    assert torch.isfinite(flat_params(model)).all()


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_zero3_oom_in_the_first_of_two_micro_batches_is_retried_on_every_rank(world, phase):
    # The failed rank still owes the rest of this micro-batch and all of the next one: every unit's
    # allgathers (forward and backward, prefetched or not on its peers) and reduce-scatters.
    from hvdtrain.config import FaultsConfig

    base = config(3, "sgd", accumulation=2, batch_size=8, epochs=2)
    injected = dataclasses.replace(base, faults=FaultsConfig(oom_above=4, oom_rank=world.size - 1, oom_step=2,
                                                             oom_in=phase))
    model, reference = UserModel(), UserModel()
    reference.load_state_dict(model.state_dict())
    result = train(world, dataclasses.replace(injected, memory=dataclasses.replace(injected.memory,
                                                                                  zero3_units="Layer")), model)
    expected = train(world, dataclasses.replace(base, memory=dataclasses.replace(base.memory, zero3_units="Layer")),
                     reference)
    assert [(r["step"], r["micro_batch"], r["accumulation"]) for r in result.history
            if r.get("event") == "oom"] == [(3, 4, 4)]
    assert result.step == expected.step and result.skipped == 0
    torch.testing.assert_close(flat_params(model), flat_params(reference), rtol=1e-5, atol=1e-6)


def test_zero3_leaves_frozen_parameters_whole_and_equal_on_every_rank(world):
    # A frozen layer is not cut (nothing updates it); rank 0's copy still reaches every rank.
    torch.manual_seed(world.rank)  # other initial weights on every rank
    model = UserModel()
    model.extra.fc.requires_grad_(False)
    frozen = model.extra.fc.weight
    train(world, config(3, "adam", units="Layer"), model)
    every = world.allgather_object((frozen.detach().clone(), flat_params(model)), name="t.zero3.frozen")
    assert all(torch.equal(every[0][0], f) and torch.equal(every[0][1], p) for f, p in every)
    torch.manual_seed(0)
    assert torch.equal(frozen.detach(), UserModel().extra.fc.weight.detach())  # rank 0's, untrained
