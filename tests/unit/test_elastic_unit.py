"""Elastic state in one process: commit/restore, and an elastic fit at size 1 equals a fixed one."""

import dataclasses

import torch
from helpers import blobs, flat_params, mlp, small_config

import hvdtrain
from hvdtrain.config import ElasticConfig
from hvdtrain.data import ShardedBatchSampler
from hvdtrain.elastic import ElasticState
from hvdtrain.state import OptimizerState, Registry


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.n = state["n"]


def _one_step(model, opt):
    opt.zero_grad()
    model(torch.randn(4, 12)).sum().backward()
    opt.step()


def test_restore_returns_to_the_commit_and_the_commit_survives_later_steps(world):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _one_step(model, opt)  # momentum buffers exist
    sampler = ShardedBatchSampler(64, world, 4, keep_global_batch=True)
    counter = Counter()
    registry = Registry()
    registry.add_all({"model": model, "optimizer": OptimizerState(opt), "sampler": sampler, "counter": counter})
    state = ElasticState(world, model, registry)
    sampler.advance(sampler.global_batch)
    counter.n, state.step = 7, 1
    state.commit()
    committed = flat_params(model).clone(), opt.state_dict()["state"][0]["momentum_buffer"].clone()
    for _ in range(2):  # uncommitted work, restored twice: the saved copy must not be updated in place
        _one_step(model, opt)
        sampler.advance(sampler.global_batch)
        counter.n, state.step = 9, 3
        state.restore()
        assert torch.equal(flat_params(model), committed[0])
        assert torch.equal(opt.state_dict()["state"][0]["momentum_buffer"], committed[1])
        assert (sampler.consumed, counter.n, state.step) == (sampler.global_batch, 7, 1)
        assert all(p.grad is None for p in model.parameters())


def test_elastic_fit_at_size_one_equals_a_fixed_run(world):
    cfg = small_config(shuffle=True)
    elastic_cfg = dataclasses.replace(cfg, elastic=ElasticConfig(enabled=True, commit_every=3))
    runs = []
    for c in (cfg, elastic_cfg):
        model = mlp(seed=0)
        result = hvdtrain.fit(world, model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), blobs(), c)
        runs.append((result.step, flat_params(model)))
    assert runs[0][0] == runs[1][0] > 0
    assert torch.equal(runs[0][1], runs[1][1])
