import math

import pytest
import torch

from hvdtrain.adaptive import goodput
from hvdtrain.config import OptimConfig
from hvdtrain.optim import LRSchedule, build_optimizer, rescale_second_moment, scale_factor


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


def _adam_second_moment(batch, steps, g_true, sigma):
    """Adam after `steps` synthetic gradients G + N(0, σ²/batch) per element (lr 0: the parameter
    stays put, as the gradient model assumes)."""
    param = torch.nn.Parameter(torch.zeros_like(g_true))
    opt = torch.optim.Adam([param], lr=0.0)
    for _ in range(steps):
        param.grad = g_true + sigma * torch.randn_like(g_true) / math.sqrt(batch)
        opt.step()
    return opt, param


def test_rescaled_adam_second_moment_matches_a_run_at_the_new_batch():
    torch.manual_seed(0)
    d = 4000
    g_true, sigma = torch.full((d,), 0.05), 0.5  # |G|² = 10, tr(Σ) = 1000: noise scale 100
    phi = d * sigma**2 / g_true.square().sum().item()
    opt, param = _adam_second_moment(8, 4000, g_true, sigma)
    before = opt.state[param]["exp_avg_sq"].sum().item()
    ratio = goodput.second_moment_ratio(phi, 8, 64)
    assert rescale_second_moment(opt, ratio)
    fresh_opt, fresh_param = _adam_second_moment(64, 4000, g_true, sigma)
    want = fresh_opt.state[fresh_param]["exp_avg_sq"].sum().item()
    # Σ v ≈ |G|² + tr(Σ)/B at either batch; the rescaled state is where a run at B=64 settles.
    assert opt.state[param]["exp_avg_sq"].sum().item() == pytest.approx(want, rel=0.03)
    assert before == pytest.approx(10 + 1000 / 8, rel=0.03) and want == pytest.approx(10 + 1000 / 64, rel=0.03)


def test_second_moment_ratio_edges_and_non_adam_optimizers_are_left_alone():
    assert goodput.second_moment_ratio(float("nan"), 8, 64) == 1.0
    assert goodput.second_moment_ratio(float("inf"), 8, 64) == pytest.approx(1 / 8)
    assert goodput.second_moment_ratio(100.0, 64, 8) == pytest.approx((1 + 100 / 8) / (1 + 100 / 64))
    p = torch.nn.Parameter(torch.ones(3))
    sgd = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.ones(3)
    sgd.step()
    momentum = sgd.state[p]["momentum_buffer"].clone()
    assert not rescale_second_moment(sgd, 0.5)
    assert torch.equal(sgd.state[p]["momentum_buffer"], momentum)
