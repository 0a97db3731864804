"""The adaptive controller and the variable-shape sampler it drives (one process, fake worlds)."""

import dataclasses

import pytest
import torch
from helpers import blobs, mlp, small_config

from hvdtrain.adaptive.controller import AdaptiveController
from hvdtrain.config import AdaptiveConfig, Config, TrainConfig, build
from hvdtrain.data import ShardedBatchSampler
from hvdtrain.errors import ConfigError
from hvdtrain.tasks import classification_loss
from hvdtrain.world import World


def fake_world(rank, size):
    return World(rank, size, rank, size, torch.device("cpu"))


def test_bad_settings_give_clear_errors():
    with pytest.raises(ConfigError, match="train.batch_size=0 must be >= 1"):
        TrainConfig(batch_size=0)
    with pytest.raises(ConfigError, match="adaptive.lr_rule='cubic' is not allowed; choose one of adascale"):
        build(overrides=["adaptive.lr_rule=cubic"])
    with pytest.raises(ConfigError, match="adaptive.max_batch=8 is below the starting global batch"):
        build(overrides=["adaptive.enabled=true", "adaptive.max_batch=8", "train.batch_size=16"])
    with pytest.raises(ConfigError, match="adaptive.max_micro_batch=-1 must be >= 0"):
        AdaptiveConfig(max_micro_batch=-1)
    # B_max < B0 only known with the world size: the controller checks it.
    cfg = dataclasses.replace(small_config(batch_size=4, accumulation=2),
                              adaptive=AdaptiveConfig(enabled=True, max_batch=12))
    sampler = ShardedBatchSampler(192, fake_world(0, 2), 4, 2, variable=True)
    model = mlp()
    with pytest.raises(ConfigError, match=r"max_batch=12 is below the starting global batch 16 \(2 ranks x 4 x 2\)"):
        AdaptiveController(fake_world(0, 2), cfg, model, torch.optim.SGD(model.parameters(), lr=0.1), None, sampler,
                           blobs(), classification_loss)


def test_sampler_batch_changes_mid_epoch_lose_and_repeat_nothing():
    n_samples, size = 200, 2
    samplers = [ShardedBatchSampler(n_samples, fake_world(r, size), 2, 1, seed=3, variable=True) for r in range(size)]
    plan = [(2, 1), (2, 2), (4, 1), (3, 3), (1, 5)]  # (m, k) per step, then the last one repeated
    used, step = [], 0
    while not samplers[0].epoch_done:
        m, k = plan[min(step, len(plan) - 1)]
        for s in samplers:
            s.reshape(m, k)
        if samplers[0].epoch_done:
            break
        for s in samplers:
            used += [i for mb in s.step_indices() for i in mb]
            assert all(len(mb) == m for mb in s.step_indices()) and len(s.step_indices()) == k
        for s in samplers:
            s.advance(s.global_batch)
        step += 1
    assert len(used) == len(set(used)) and n_samples - len(used) < 2 * 1 * 5


def test_step_indices_match_the_fixed_sampler():
    s = ShardedBatchSampler(103, fake_world(1, 3), 5, 2, seed=7)
    fixed = list(iter(s))
    got = []
    while not s.epoch_done:
        got += s.step_indices()
        s.advance(s.global_batch)
    assert got == fixed


def test_a_checkpoint_from_another_world_size_keeps_its_batch_and_probes_again():
    # An elastic run at 2 ranks checkpoints B = 64; a relaunch on 1 rank (same B0 = 16) resumes it.
    from hvdtrain.comm.reducer import GradReducer

    def controller(world, batch_size):
        cfg = Config(adaptive=AdaptiveConfig(enabled=True, max_batch=64), train=TrainConfig(batch_size=batch_size))
        model = mlp()
        return AdaptiveController(world, cfg, model, torch.optim.SGD(model.parameters(), lr=0.1),
                                  GradReducer(world, model.named_parameters()),
                                  ShardedBatchSampler(192, world, batch_size, variable=True), blobs(n=192),
                                  classification_loss)

    saved = controller(fake_world(0, 2), 8)
    saved.set_shape(16, 2)
    saved.probed = True
    resumed = controller(fake_world(0, 1), 16)
    resumed.load_state_dict(saved.state_dict())
    assert (resumed.m, resumed.k, resumed.batch) == (16, 4, 64)  # not 1 x 16 x 2 = 32
    assert resumed.sampler.global_batch == 64 and not resumed.probed
