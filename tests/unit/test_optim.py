import math

import pytest
import torch

from hvdtrain.config import OptimConfig
from hvdtrain.optim import LRSchedule, build_optimizer, scale_factor


@pytest.mark.parametrize("rule, expected", [("linear", 8.0), ("sqrt", math.sqrt(8)), ("none", 1.0)])
def test_scale_rules(rule, expected):
    assert scale_factor(rule, 4, 2) == pytest.approx(expected)


def test_warmup_then_cosine_to_zero():
    model = torch.nn.Linear(2, 2)
    opt = build_optimizer(model, OptimConfig(lr=0.1))
    sched = LRSchedule(opt, OptimConfig(lr=0.1, warmup_steps=4, schedule="cosine"), ranks=2, accumulation=1,
                       total_steps=14)
    lrs = [sched.apply(s) for s in range(14)]
    assert lrs[:4] == pytest.approx([0.125, 0.15, 0.175, 0.2])
    assert lrs[4] == pytest.approx(0.2) and lrs[9] == pytest.approx(0.1)
    assert lrs[13] < 0.01 and all(a >= b for a, b in zip(lrs[4:], lrs[5:]))


def test_groups_keep_their_own_base_lr():
    a, b = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    opt = torch.optim.SGD([{"params": a.parameters(), "lr": 0.1}, {"params": b.parameters(), "lr": 0.01}])
    LRSchedule(opt, OptimConfig(lr_scaling="linear"), 4, 1, 10).apply(0)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.4, 0.04])
