"""Metric averaging with unequal shards, against a single-process computation."""

import re

import pytest
import torch
from helpers import blobs, mlp, small_config
from torch.utils.data import TensorDataset

import hvdtrain
from hvdtrain.loop import evaluate
from hvdtrain.metrics import MetricSums
from hvdtrain.tasks import classification_loss


class Scale(torch.nn.Module):
    def forward(self, x):
        return x * 1.0


def per_sample_loss(model, batch):
    x, y = batch
    out = model(x)
    return out.mean(), {"hits": (out > y).sum()}


def test_eval_average_with_unequal_shards_equals_full_dataset(world):
    n = 3 * world.size + 1  # never divisible: rank 0 gets one more sample than the others
    x = torch.arange(n, dtype=torch.float32) ** 1.5
    y = torch.full((n,), 4.0)
    result = evaluate(world, Scale(), TensorDataset(x, y), per_sample_loss, batch_size=2)
    # Batch means are fp32; the weighting by samples is exact, so only fp32 rounding remains.
    assert abs(result["loss"] - x.double().mean().item()) < 1e-6 * x.abs().max().item()
    assert abs(result["hits"] - (x > 4.0).double().mean().item()) < 1e-12


def test_metric_sums_weight_by_samples(world):
    sums = MetricSums()
    # rank r sees r+1 samples whose loss is r: the mean over all samples weights ranks unequally.
    sums.add(torch.tensor(float(world.rank)), {}, world.rank + 1)
    got = sums.reduce(world, "test.metrics", ("loss",))
    n = world.size
    expected = sum(r * (r + 1) for r in range(n)) / sum(r + 1 for r in range(n))
    assert abs(got["loss"] - expected) < 1e-12


def test_a_metric_returned_as_a_python_number_is_summed_like_a_tensor(world):
    def loss_fn(model, batch):
        loss, sums = classification_loss(model, batch)
        return loss, {"accuracy": int(sums["accuracy"]), "count": float(len(batch[1]))}

    cfg = small_config(epochs=1, accumulation=1)
    numbers = hvdtrain.fit(world, mlp(seed=2), None, blobs(), cfg, eval_set=blobs(n=50, seed=1), loss_fn=loss_fn)
    tensors = hvdtrain.fit(world, mlp(seed=2), None, blobs(), cfg, eval_set=blobs(n=50, seed=1))
    assert numbers.eval["accuracy"] == tensors.eval["accuracy"] and numbers.eval["count"] == 1.0


@pytest.mark.parametrize("bad, message", [
    (lambda loss, sums: (loss, {"accuracy": sums["accuracy"].repeat(3)}),
     "loss_fn's metric 'accuracy' must be one number (a Python number or a one-element tensor: the batch's sum), "
     "got shape (3,)"),
    (lambda loss, sums: (loss, {"accuracy": [1, 2]}), "loss_fn's metric 'accuracy' must be one number"),
    (lambda loss, sums: (loss.item(), sums), "loss_fn's loss must be a one-element tensor (the batch's mean loss), "
                                              "got float"),
    (lambda loss, sums: (loss.detach(), sums), "loss_fn's loss does not require grad"),
    (lambda loss, sums: loss, "loss_fn must return (loss, {metric: batch sum}), got Tensor"),
    (lambda loss, sums: (loss, [sums]), "loss_fn's metrics must be a dict {name: batch sum}, got list"),
])
def test_a_loss_fn_that_breaks_its_contract_gets_a_message_saying_what_it_must_return(world, bad, message):
    def loss_fn(model, batch):
        return bad(*classification_loss(model, batch))

    with pytest.raises(TypeError, match=re.escape(message)):
        hvdtrain.fit(world, mlp(seed=2), None, blobs(), small_config(epochs=1), loss_fn=loss_fn)
