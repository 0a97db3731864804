"""The gradient noise scale: the estimators, their averages, the norm meter and Adam's preconditioner (one process)."""

import math

import pytest
import torch
from helpers import blobs, mlp

from hvdtrain.adaptive.gns import GradNormMeter, NoiseScale, SampleAverage, estimate
from hvdtrain.tasks import classification_loss


@pytest.mark.parametrize("count, m", [(2, 4), (8, 16)])
def test_estimators_are_unbiased_on_synthetic_gradients(count, m):
    # Per-sample gradients G + noise with known |G|² and tr(Σ); micro-batch means of m samples.
    g = torch.Generator().manual_seed(count)
    dim, trials = 50, 4000
    true_g = torch.randn(dim, generator=g, dtype=torch.float64) * 0.3
    stds = torch.rand(dim, generator=g, dtype=torch.float64) * 2
    samples = true_g + stds * torch.randn(trials, count, m, dim, generator=g, dtype=torch.float64)
    micro = samples.mean(dim=2)  # (trials, count, dim)
    local = micro.pow(2).sum(-1).mean(-1)
    glob = micro.mean(dim=1).pow(2).sum(-1)
    est = [estimate(float(a), float(b), count, m) for a, b in zip(local, glob)]
    g2s, traces = torch.tensor([e[0] for e in est]), torch.tensor([e[1] for e in est])
    want_g2, want_trace = float(true_g.pow(2).sum()), float(stds.pow(2).sum())
    # Unbiased: the mean of the estimates is within 4 standard errors of the truth.
    assert abs(g2s.mean() - want_g2) < 4 * g2s.std() / math.sqrt(trials)
    assert abs(traces.mean() - want_trace) < 4 * traces.std() / math.sqrt(trials)
    # The naive single-replica ratio would be biased by tr(Σ)/m: the test can tell the difference.
    assert abs(local.mean() - want_g2) > 10 * g2s.std() / math.sqrt(trials)


def test_sample_average_is_bias_corrected_and_counts_samples():
    a, b = SampleAverage(0.9, unit=8), SampleAverage(0.9, unit=8)
    a.update(3.0, 8)
    assert a.value == pytest.approx(3.0)  # one observation: no pull towards zero
    for _ in range(4):
        a.update(1.0, 8)
    b.update(3.0, 8)
    b.update(1.0, 32)  # one step of 4x the samples forgets as much as four steps
    assert a.value == pytest.approx(b.value)


def test_noise_scale_is_infinite_when_the_gradient_estimate_is_not_positive():
    ns = NoiseScale(0.99, 8)
    ns.update(local_sq_mean=2.0, global_sq=0.5, count=2, micro_batch=4)  # |G|² = (1 - 2) / 1 < 0
    assert ns.phi == math.inf


def test_meter_measures_each_micro_batch_before_accumulation():
    model = mlp(seed=1)
    data = blobs(n=24)
    x, y = data.tensors
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    meter = GradNormMeter(model.parameters(), opt, precondition=True)
    k, want = 3, 0.0
    for j in range(k):  # reference: each micro-batch's gradient on its own
        model.zero_grad()
        classification_loss(model, (x[j * 8:(j + 1) * 8], y[j * 8:(j + 1) * 8]))[0].backward()
        want += sum(float(p.grad.double().pow(2).sum()) for p in model.parameters())
    model.zero_grad()
    meter.begin_step()
    for j in range(k):  # as the trainer does it: accumulate loss / k
        meter.next_micro_batch()
        (classification_loss(model, (x[j * 8:(j + 1) * 8], y[j * 8:(j + 1) * 8]))[0] / k).backward()
    assert meter.local_sum(1.0 / k) == pytest.approx(want, rel=1e-6)  # fp32 gradients, summed in fp64
    meter.remove()


@pytest.mark.parametrize("precondition", [True, False])
def test_meter_on_the_reducer_buckets_equals_the_per_tensor_hooks(world, precondition):
    from hvdtrain.comm.reducer import GradReducer

    model = mlp(seed=3)
    x, y = blobs(n=16).tensors
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    classification_loss(model, (x, y))[0].backward()
    opt.step()  # Adam's state exists: the preconditioned geometry
    opt.zero_grad()
    # A tiny bucket cap splits the model into several buckets, each measured on its own flat buffer.
    reducer = GradReducer(world, model.named_parameters(), bucket_mb=1e-4)
    assert len(reducer.buckets) > 1
    meter = GradNormMeter(model.parameters(), opt, precondition=precondition)
    assert meter.use_buckets(reducer.buckets)
    reducer.add_tap(meter.bucket_ready)
    got = {}
    for micro_batches in (2, 1):  # 2: the hooks measure (one micro-batch run here); 1: the buckets
        reducer.zero_grad()
        meter.begin_step(micro_batches)
        assert meter.flat == (micro_batches == 1)
        meter.next_micro_batch()
        classification_loss(model, (x[:8], y[:8]))[0].backward()
        reducer.launch_rest()
        local = meter.local_sum(1.0)
        assert reducer.synchronize()
        on_buckets, per_tensor = meter.global_sq(reducer.flats()), meter.global_sq()
        assert on_buckets == pytest.approx(per_tensor, rel=1e-6)
        got[micro_batches] = (local, on_buckets)
    assert got[1][0] > 0 and got[1][1] > 0
    assert got[1] == pytest.approx(got[2], rel=1e-6)
    reducer.remove()
    meter.remove()
    assert not GradNormMeter(model.parameters(), opt, precondition=True).use_buckets(reducer.buckets[1:])


def test_adam_preconditioner_caps_elements_adam_has_not_seen_yet():
    from hvdtrain.adaptive.gns import FLOOR_WEIGHT, GradNormMeter

    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 4)
    opt = torch.optim.Adam(emb.parameters(), lr=1e-3)
    emb(torch.tensor([0, 1, 2])).sum().backward()  # rows 3..9 get no gradient: v̂ stays 0 there
    opt.step()
    weights = GradNormMeter(emb.parameters(), opt, precondition=True).preconditioner()[id(emb.weight)].double()
    root = (opt.state[emb.weight]["exp_avg_sq"] / (1 - 0.999)).sqrt().double()
    assert float(weights.max()) <= FLOOR_WEIGHT / float(root.mean()) * (1 + 1e-6)  # not 1/eps = 1e8
    seen = root > 0
    # Used rows: Adam's own geometry (the weights are kept in the state's fp32).
    torch.testing.assert_close(weights[seen], 1 / (root[seen] + 1e-8), rtol=1e-6, atol=0)


def test_adam_preconditioner_is_rebuilt_every_step_early_then_at_most_every_refresh_max_steps():
    from hvdtrain.adaptive.gns import REFRESH_MAX

    torch.manual_seed(0)
    model = mlp(seed=2)
    x, y = blobs(n=32).tensors
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    meter = GradNormMeter(model.parameters(), opt, precondition=True)
    rebuilt, last = [], None
    for step in range(400):
        meter.begin_step()
        if meter.scale and meter.scale is not last:
            rebuilt.append(step)
            want = meter.preconditioner()  # what a rebuild now would give: the frozen one it replaced matches
            for p in model.parameters():
                torch.testing.assert_close(meter.scale[id(p)], want[id(p)], rtol=0, atol=0)
        last = meter.scale
        meter.next_micro_batch()
        opt.zero_grad()
        classification_loss(model, (x, y))[0].backward()
        meter.local_sum(1.0)
        opt.step()
    assert meter.scale  # Adam's state existed from step 1 on
    assert rebuilt[:20] == list(range(1, 21))  # v̂ moves fast while it averages few steps
    gaps = [b - a for a, b in zip(rebuilt, rebuilt[1:])]
    assert max(gaps) == REFRESH_MAX and gaps == sorted(gaps)
    meter.remove()


def _phi_after_spike(monkeypatch, spike_guard: float) -> tuple[float, float]:
    from hvdtrain.adaptive import gns

    monkeypatch.setattr(gns, "SPIKE", spike_guard)
    ns = NoiseScale(0.99, 8)
    for _ in range(50):  # |G|² = 0.5, tr(Σ) = 4: φ = 8
        ns.update(local_sq_mean=1.5, global_sq=1.0, count=2, micro_batch=4)
    ns.update(local_sq_mean=150.0, global_sq=100.0, count=2, micro_batch=4)  # a 100x gradient spike
    for _ in range(100):  # |G|² = 0.1, tr(Σ) = 7.2: φ = 72
        ns.update(local_sq_mean=1.9, global_sq=1.0, count=2, micro_batch=4)
    steady = NoiseScale(0.99, 8)
    for _ in range(50):
        steady.update(local_sq_mean=1.5, global_sq=1.0, count=2, micro_batch=4)
    for _ in range(100):
        steady.update(local_sq_mean=1.9, global_sq=1.0, count=2, micro_batch=4)
    return ns.phi, steady.phi


def test_one_gradient_spike_does_not_freeze_the_noise_scale(monkeypatch):
    guarded, steady = _phi_after_spike(monkeypatch, 10.0)
    unguarded, _ = _phi_after_spike(monkeypatch, math.inf)
    assert steady > 30  # the run without a spike has moved well on from 8 towards 72
    assert unguarded < 0.6 * steady  # the spike's weight holds φ back towards its own ratio of 8
    assert guarded > 0.85 * steady
