"""The non-finite policy: skip, or stop after K steps in a row, on every rank at the same step."""

import dataclasses

import pytest
import torch
from helpers import blobs, flat_params, mlp, small_config

import hvdtrain
from hvdtrain.errors import TrainingStopped
from hvdtrain.tasks import classification_loss


def poisoned_from(step, world):
    calls = [0]

    def loss_fn(model, batch):
        loss, sums = classification_loss(model, batch)
        calls[0] += 1
        if world.rank == world.size - 1 and calls[0] >= step:
            loss = loss * float("nan")  # only the last rank goes bad, from `step` on
        return loss, sums

    return loss_fn


def test_stop_after_k_non_finite_steps_in_a_row_on_every_rank(world):
    cfg = small_config(epochs=2, accumulation=1)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, stop_after_skips=3))
    model = mlp(seed=4)
    with pytest.raises(TrainingStopped, match=r"stopped at step 7: 3 steps in a row had a non-finite"):
        hvdtrain.fit(world, model, None, blobs(), cfg, loss_fn=poisoned_from(5, world))
    every = world.allgather_object(flat_params(model), name="t.nonfinite.params")
    assert all(torch.equal(every[0], p) for p in every) and torch.isfinite(every[0]).all()


def test_skipping_forever_when_no_limit_is_set(world):
    cfg = small_config(epochs=1, accumulation=1)
    result = hvdtrain.fit(world, mlp(seed=4), None, blobs(), cfg, loss_fn=poisoned_from(5, world))
    assert result.skipped == result.step - 4
