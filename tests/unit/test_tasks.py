import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hvdtrain.config import build
from hvdtrain.errors import ConfigError, DataError
from hvdtrain.tasks import build_task


def _mnist1d(*overrides: str):
    return build_task(build(None, ["data.mnist1d_samples=5000", *overrides], task="mnist1d"))


def test_mnist1d_builds_signals_and_leaves_the_callers_random_state_alone():
    np.random.seed(3)
    random.seed(3)
    expected = (np.random.rand(), random.random())
    np.random.seed(3)
    random.seed(3)
    task = _mnist1d("data.val_fraction=0.2")
    assert (np.random.rand(), random.random()) == expected
    x, y = task.train_set.tensors
    xv, yv = task.eval_set.tensors
    assert x.shape == (4000, 1, 40) and xv.shape == (1000, 1, 40) and x.dtype == torch.float32
    assert sorted(y.unique().tolist()) == list(range(10)) and sorted(yv.unique().tolist()) == list(range(10))
    assert task.model(xv[:3]).shape == (3, 10)


def test_mnist1d_data_is_the_same_for_every_seed_and_the_model_is_not():
    a, b = _mnist1d("seed=0"), _mnist1d("seed=1")
    assert torch.equal(a.train_set.tensors[0], b.train_set.tensors[0])
    assert torch.equal(a.eval_set.tensors[1], b.eval_set.tensors[1])
    wa, wb = (next(t.model.parameters()) for t in (a, b))
    assert not torch.equal(wa, wb)


def test_mnist1d_is_learnable_by_its_model():
    task = _mnist1d()
    x, y = task.train_set.tensors
    xv, yv = task.eval_set.tensors
    opt = torch.optim.Adam(task.model.parameters(), lr=0.004)
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        idx = torch.randint(0, len(y), (64,), generator=g)
        loss, _ = task.loss_fn(task.model, (x[idx], y[idx]))
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        logits = task.model(xv)
    # Chance is ln 10 = 2.30 and 10% accuracy.
    assert F.cross_entropy(logits, yv) < 1.0 and (logits.argmax(1) == yv).float().mean() > 0.6


def test_mnist1d_bad_sizes_are_clear_errors():
    with pytest.raises(ConfigError, match="data.mnist1d_samples"):
        build(None, ["data.mnist1d_samples=5"], task="mnist1d")
    with pytest.raises(DataError, match="raise data.mnist1d_samples"):
        _mnist1d("data.mnist1d_samples=20", "data.val_fraction=0.999")
