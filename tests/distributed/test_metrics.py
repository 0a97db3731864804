"""Metric averaging with unequal shards, against a single-process computation."""

import torch
from torch.utils.data import TensorDataset

from hvdtrain.loop import evaluate
from hvdtrain.metrics import MetricSums


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
