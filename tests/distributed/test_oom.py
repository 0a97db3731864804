"""Faults at a fixed batch size: an out-of-memory on one rank, under horovodrun at any world size."""

import dataclasses

import pytest
import torch
from helpers import blobs, flat_params, mlp, small_config

import hvdtrain
from hvdtrain.config import FaultsConfig
from hvdtrain.errors import TrainingStopped
from hvdtrain.tasks import classification_loss


def fixed_config(batch_size=8, accumulation=1, on_oom="retry", **faults):
    cfg = small_config(epochs=2, batch_size=batch_size, accumulation=accumulation, shuffle=True)
    # Tiny buckets: several launch during the backward, so an OOM mid-backward finds some in flight.
    comm = dataclasses.replace(cfg.comm, bucket_mb=1e-6)
    return dataclasses.replace(cfg, comm=comm, train=dataclasses.replace(cfg.train, on_oom=on_oom),
                               faults=FaultsConfig(**faults))


def oom_events(history):
    return [(r["step"], r["micro_batch"], r["accumulation"]) for r in history if r.get("event") == "oom"]


@pytest.mark.parametrize("phase, zero", [("forward", 0), ("backward", 0), ("backward", 1), ("backward", 2),
                                         ("forward", 3), ("backward", 3)])
def test_oom_on_one_rank_at_step_k_retries_and_ends_with_the_same_weights(world, phase, zero):
    # ZeRO 1 and 2 too: the NaN the failed attempt sent must not outlive it (stage 1 reuses its
    # gradient buffers, padding included). Under ZeRO-3 the failed rank also joins the allgathers of
    # the units it never reached, or its peers would wait in them for ever.
    oom_step = 3
    injected = fixed_config(oom_above=4, oom_rank=world.size - 1, oom_step=oom_step, oom_in=phase)
    injected = dataclasses.replace(injected, memory=dataclasses.replace(injected.memory, zero_stage=zero))
    model, reference_model = mlp(seed=6), mlp(seed=6)
    result = hvdtrain.fit(world, model, None, blobs(), injected)
    reference = hvdtrain.fit(world, reference_model, None, blobs(), fixed_config())
    # The step that ran out of memory (the 4th, 0-based 3) is retried in micro-batches of 4, twice
    # each, and stays so: logged once, on every rank alike.
    assert oom_events(result.history) == [(oom_step + 1, 4, 2)]
    assert result.step == reference.step and result.skipped == reference.skipped == 0
    # The same samples, lr and global batch; only the order of float sums differs (measured: max
    # difference ~1e-7 on these weights of magnitude ~1).
    torch.testing.assert_close(flat_params(model), flat_params(reference_model), rtol=1e-5, atol=1e-6)
    every = world.allgather_object(flat_params(model), name="t.faults.params")
    assert all(torch.equal(every[0], p) for p in every)


def test_oom_at_one_sample_stops_every_rank_with_a_clear_message(world):
    # Every micro-batch on the last rank runs out of memory from the 3rd call on: 8 -> 4 -> 2 -> 1 -> stop.
    calls = [0]

    def loss_fn(model, batch):
        calls[0] += 1
        if world.rank == world.size - 1 and calls[0] >= 3:
            raise torch.OutOfMemoryError("CUDA out of memory (a test's)")
        return classification_loss(model, batch)

    model = mlp(seed=6)
    with pytest.raises(TrainingStopped, match=r"out of memory with a micro-batch of 1 sample"):
        hvdtrain.fit(world, model, None, blobs(), fixed_config(), loss_fn=loss_fn)
    every = world.allgather_object(flat_params(model), name="t.faults.stopped")
    assert all(torch.equal(every[0], p) for p in every) and torch.isfinite(every[0]).all()


def test_on_oom_stop_stops_every_rank_at_the_step(world):
    injected = fixed_config(on_oom="stop", oom_above=4, oom_rank=world.size - 1, oom_step=2)
    want = r"stopped at step 3: out of memory at a micro-batch of 8 \(train.on_oom=stop\)"
    with pytest.raises(TrainingStopped, match=want):
        hvdtrain.fit(world, mlp(seed=6), None, blobs(), injected)
