"""Adaptive batch sizing in one process: estimators, the norm meter, decisions, settings, sampling, probe."""

import dataclasses
import math

import pytest
import torch
from helpers import blobs, mlp, small_config

from hvdtrain.adaptive import goodput
from hvdtrain.adaptive.controller import AdaptiveController
from hvdtrain.adaptive.gns import GradNormMeter, NoiseScale, SampleAverage, estimate
from hvdtrain.adaptive.probe import FaultInjector, Prober, is_oom, shrink_after_oom
from hvdtrain.config import AdaptiveConfig, Config, TrainConfig, build
from hvdtrain.data import ShardedBatchSampler
from hvdtrain.errors import ConfigError, TrainingStopped
from hvdtrain.tasks import classification_loss
from hvdtrain.world import World


def fake_world(rank, size):
    return World(rank, size, rank, size, torch.device("cpu"))


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
    reducer.before_launch = meter.bucket_ready
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


def test_gain_lr_rules_and_efficiency():
    assert goodput.gain(float("nan"), 64, 8) == 1.0
    assert goodput.gain(float("inf"), 64, 8) == 8.0
    r = goodput.gain(16.0, 64, 8)
    assert r == pytest.approx((1 + 16 / 8) / (1 + 16 / 64)) and 1 <= r <= 8
    assert goodput.lr_factor("adascale", True, 16.0, 64, 8) == pytest.approx(math.sqrt(r))
    assert goodput.lr_factor("linear", False, 16.0, 64, 8) == 8.0
    assert goodput.efficiency(16.0, 64, 8) == pytest.approx(r * 8 / 64)


def limits(**kw):
    base = {"ranks": 2, "base": 16, "max_batch": 1024, "cap": 64, "min_k": 1, "hysteresis": 0.05,
            "max_growth": 2.0, "theta": 0.0}
    return goodput.Limits(**{**base, **kw})


def test_decision_grows_at_most_2x_and_follows_goodput():
    # Fixed cost per step (sync) dominates: bigger batches pay as long as the noise scale is large.
    times = goodput.StepTimeModel({8: 0.01}, sync=1.0)
    m, k = goodput.decide(limits(), times, 1e6, (8, 1), [8, 16, 32, 64])
    assert 2 * m * k == 32  # the 2x cap
    # Tiny noise scale: no statistical benefit, stay.
    assert goodput.decide(limits(), times, 0.01, (8, 1), [8, 16, 32, 64]) == (8, 1)


def test_norm_test_floor_forces_growth_and_hysteresis_blocks_small_gains():
    times = goodput.StepTimeModel({8: 1.0, 16: 2.0})  # throughput flat in m: goodput favours B0
    assert goodput.decide(limits(), times, 100.0, (8, 1), [8, 16]) == (8, 1)
    m, k = goodput.decide(limits(theta=1.0), times, 100.0, (8, 1), [8, 16])
    assert 2 * m * k == 32  # floor 100 > 32, capped by the 2x growth window
    times = goodput.StepTimeModel({8: 1.0}, sync=0.02)  # ~1% gain from amortising sync: below 5%
    assert goodput.decide(limits(), times, 1e6, (8, 1), [8, 16]) == (8, 1)


def test_a_batch_keeps_its_micro_batch_unless_another_split_is_clearly_faster():
    # Per-sample time nearly flat in m (a few % apart, the size of timing noise): growing from
    # B = 32 to 64 keeps m and doubles k, whichever split the noise favours.
    times = goodput.StepTimeModel({4: 1.0, 8: 1.98, 16: 4.0, 32: 8.1})
    lim = limits(base=16, max_batch=64, theta=1.0)
    assert goodput.decide(lim, times, 100.0, (4, 4), [4, 8, 16, 32]) == (4, 8)
    assert goodput.decide(lim, times, 100.0, (16, 1), [4, 8, 16, 32]) == (16, 2)
    # A split clearly (> hysteresis) faster wins.
    assert goodput.decide(lim, goodput.StepTimeModel({4: 1.0, 8: 1.5, 16: 4.0, 32: 8.1}), 100.0, (4, 4),
                          [4, 8, 16, 32]) == (8, 4)
    # The running micro-batch is not a candidate size: the largest of the near-best splits.
    assert goodput.decide(lim, times, 100.0, (2, 8), [4, 8, 16, 32]) == (32, 1)


def test_norm_test_floor_has_a_band_so_a_noisy_noise_scale_does_not_flip_the_batch():
    # Recorded on pylm (seed 2, 4 December, θ = 1): φ read 45 at step 320 (B 32 -> 64), 31 at step
    # 410 (back to 32: the floor allowed it and goodput preferred it), 36 at 460 (64 again); at
    # step 210 φ = 15 took B from 32 to 16 and φ = 16.6 took it back at 250.
    times = goodput.StepTimeModel({8: 0.01051, 16: 0.0184, 32: 0.03322}, sync=0.0063)
    lim = limits(base=8, max_batch=128, theta=1.0)
    sizes = [4, 8, 16, 32, 64]
    assert goodput.decide(lim, times, 45.4, (16, 1), sizes) == (32, 1)  # under the floor: grow
    assert goodput.decide(lim, times, 31.2, (32, 1), sizes) == (32, 1)  # was (16, 1)
    assert goodput.decide(lim, times, 15.0, (16, 1), sizes) == (16, 1)  # was (8, 1)
    assert goodput.decide(lim, times, 14.0, (32, 1), sizes) == (16, 1)  # 32 >= 2 x 14: shrinks
    assert goodput.decide(limits(base=8, max_batch=128), times, 31.2, (32, 1), sizes) == (16, 1)  # θ = 0


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
    sampler = ShardedBatchSampler(192, fake_world(0, 2), 4, 2)
    model = mlp()
    with pytest.raises(ConfigError, match=r"max_batch=12 is below the starting global batch 16 \(2 ranks x 4 x 2\)"):
        AdaptiveController(fake_world(0, 2), cfg, model, torch.optim.SGD(model.parameters(), lr=0.1), None, sampler,
                           blobs(), classification_loss, lambda *a: True)


def test_sampler_batch_changes_mid_epoch_lose_and_repeat_nothing():
    n_samples, size = 200, 2
    samplers = [ShardedBatchSampler(n_samples, fake_world(r, size), 2, 1, seed=3) for r in range(size)]
    plan = [(2, 1), (2, 2), (4, 1), (3, 3), (1, 5)]  # (m, k) per step, then the last one repeated
    used, step = [], 0
    while not samplers[0].epoch_done:
        m, k = plan[min(step, len(plan) - 1)]
        for s in samplers:
            s.variable, s.micro_batch, s.accumulation, s.global_batch = True, m, k, size * m * k
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


def test_probe_bisects_to_the_injected_limit_and_respects_a_memory_budget():
    cfg = AdaptiveConfig(inject_oom_above=11)
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    prober = Prober(model, opt, blobs(n=64), classification_loss, torch.device("cpu"), FaultInjector(cfg, 0))
    assert prober.largest(start=2, limit=64, budget=2**30, margin=0.1) == 11
    assert prober.injector.raised >= 1 and opt.state  # the optimizer state was materialised first
    free = Prober(model, opt, blobs(n=64), classification_loss, torch.device("cpu"), FaultInjector(AdaptiveConfig(), 0))
    at_2, at_4 = free.step(2), free.step(4)
    budget = int((at_2 + 10 * (at_4 - at_2) / 2) / 0.9)  # room for about m = 12
    cap = free.largest(start=2, limit=64, budget=budget, margin=0.1)
    assert 10 <= cap <= 14 and free.step(cap) <= budget


def test_probe_keeps_the_fastest_run_of_each_size(monkeypatch):
    from hvdtrain.adaptive import probe as memprobe

    ticks = iter([0.0, 5.0, 10.0, 11.0, 20.0, 23.0])  # runs of 5, 1 and 3 s at the same size
    monkeypatch.setattr(memprobe.time, "perf_counter", lambda: next(ticks))
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    injector = FaultInjector(AdaptiveConfig(), 0)
    prober = Prober(model, opt, blobs(n=64), classification_loss, torch.device("cpu"), injector)
    for _ in range(3):
        prober.step(4)
    assert prober.seconds[4] == 1.0  # not the last (3 s) nor the first, allocating one (5 s)


def test_probe_times_each_size_three_times_counting_the_memory_search_runs():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prober = Prober(model, opt, blobs(n=64), classification_loss, torch.device("cpu"),
                    FaultInjector(AdaptiveConfig(), 0))
    assert prober.largest(4, 16, 2**40, 0.1) == 16  # runs 4 (twice), 8 and 16
    assert prober.runs == {4: 2, 8: 1, 16: 1}
    prober.preferred(16, 4)
    assert prober.runs == {4: 3, 8: 3, 16: 3}


def test_step_time_model_shrugs_off_one_stretched_step_but_follows_a_real_change():
    times = goodput.StepTimeModel({8: 0.010}, sync=0.005)
    times.record(8, 0.100, 0.005)  # one step 10x slower (a neighbour, a collection pause)
    assert times.micro_time(8) == pytest.approx(0.012)  # taken at 2x: +20%, not +180%
    for _ in range(12):  # the micro-batch really became 3x slower
        times.record(8, 0.030, 0.005)
    assert times.micro_time(8) == pytest.approx(0.030, rel=0.1)


def test_step_time_model_prices_unrun_sizes_by_the_probe_scaled_to_training_conditions():
    # The probe's times (pylm, 4 December): m=8 20 ms, m=16 33 ms; in training m=16 ran at ~43 ms
    # (the step's collectives beside the backward, the norm hooks). Compared raw, B=16 at m=8's
    # probe time looked better than the B=32 being run; at the same 1.3x it is not.
    times = goodput.StepTimeModel({})
    for m, t in {4: 0.018, 8: 0.020, 16: 0.033, 32: 0.071}.items():
        times.record_probe(m, t)
    assert times.micro_time(32) == 0.071  # nothing run yet: the probe's shape as it is
    for _ in range(30):
        times.record(16, 0.043, 0.015)
    assert times.micro_time(16) == pytest.approx(0.043, rel=0.01)
    assert times.micro_time(32) == pytest.approx(0.071 * 0.043 / 0.033, rel=0.01)
    lim = limits(hysteresis=0.05)
    assert goodput.decide(lim, times, 40.0, (16, 1), [4, 8, 16, 32]) == (16, 1)
    raw = goodput.StepTimeModel({4: 0.018, 8: 0.020, 16: 0.043, 32: 0.071}, sync=times.sync)
    assert goodput.decide(lim, raw, 40.0, (16, 1), [4, 8, 16, 32]) == (8, 1)
    times.record(4, 0.018, 0.015)  # a size's first sample is clipped against its prediction
    assert times.micro_time(4) == pytest.approx(0.8 * 0.018 * 0.043 / 0.033 + 0.2 * 0.018, rel=0.01)
    assert times.micro_time(8) == pytest.approx(0.020 * times.micro_time(4) / 0.018, rel=0.01)  # nearest: 4
    restored = goodput.StepTimeModel({})
    restored.load_state_dict(times.state_dict())
    assert restored == times


def test_sizes_not_running_follow_the_host_speed_measured_at_the_running_size():
    # m=4 timed at 12 ms, then m=8 at 20 ms; the host then slows 1.5x (a neighbour on the VM: 1.5x
    # drift within a day here). Frozen at 12 ms, m=4 would look 20% cheaper per sample than it is
    # and the controller would move 8 -> 4 on a stale number.
    times = goodput.StepTimeModel({})
    for _ in range(30):
        times.record(4, 0.012, 0.010)
    for _ in range(30):
        times.record(8, 0.020, 0.010)
    assert times.micro_time(4) == pytest.approx(0.012, rel=0.01)  # first samples of 8 move nothing
    for _ in range(40):
        times.record(8, 0.030, 0.015)
    assert times.micro_time(8) == pytest.approx(0.030, rel=0.01)
    assert times.micro_time(4) == pytest.approx(0.018, rel=0.01)
    lim = limits(base=8, max_batch=128)
    assert goodput.decide(lim, times, 30.0, (8, 1), [4, 8]) == (8, 1)
    stale = goodput.StepTimeModel({4: 0.012, 8: 0.030}, sync=times.sync)
    assert goodput.decide(lim, stale, 30.0, (8, 1), [4, 8]) == (4, 2)


def test_micro_batches_below_the_smallest_known_size_are_not_priced_down_a_steep_segment():
    # Recorded on pylm (seed 1, 4 December): m=4 timed at 12.2 ms early on, m=8 at 26.8 ms in a slow
    # spell; the segment's slope, extended to m=1, priced it at 3 ms (measured: 7.6 ms) and the
    # controller moved from (8, 1) to (1, 9).
    times = goodput.StepTimeModel({4: 0.01218, 8: 0.02676}, sync=0.01423)
    assert times.micro_time(1) == 0.01218
    lim = limits(base=8, max_batch=128)
    assert goodput.decide(lim, times, 31.6, (8, 1), [1, 2, 4, 8, 16, 32, 64])[0] >= 4


def test_oom_classification():
    assert is_oom(torch.OutOfMemoryError("CUDA out of memory"))
    assert is_oom(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes"))
    assert not is_oom(RuntimeError("shape mismatch"))
    assert Config().adaptive.enabled is False


def test_an_oom_shrinks_the_micro_batch_and_keeps_the_batch():
    assert shrink_after_oom(32, 1, 0.9) == (16, 2)  # 28.8 is no divisor of 32: the largest below it
    assert shrink_after_oom(24, 2, 0.9) == (16, 3)
    assert shrink_after_oom(2, 3, 0.9) == (1, 6)
    assert shrink_after_oom(7, 1, 0.9) == (1, 7)  # a prime falls to 1, never to m itself
    with pytest.raises(TrainingStopped, match="micro-batch of 1 sample"):
        shrink_after_oom(1, 8, 0.9)


def test_bench_rejects_unknown_task_before_starting(capsys):
    from hvdtrain.tools.cli import main

    assert main(["bench", "adaptive", "--tasks", "nope"]) == 2
    assert "--tasks 'nope' is not allowed; choose from pylm, digits" in capsys.readouterr().err
    assert main(["bench", "adaptive", "--tasks", "pylm", "--lrs", "pylm=fast"]) == 2
    assert "--lrs 'pylm=fast': expected TASK=VALUE,..., e.g. pylm=0.001/0.003" in capsys.readouterr().err
    assert main(["bench", "adaptive", "--tasks", "pylm", "--targets", "mnist=0.1"]) == 2
    assert "--targets names ['mnist']; choose from pylm, digits" in capsys.readouterr().err
    assert main(["bench", "adaptive", "--tasks", "pylm", "--batches", "pylm=16/8"]) == 2
    assert "--batches pylm=16/8: expected distinct global batches, smallest first" in capsys.readouterr().err
    assert main(["bench", "adaptive", "--tasks", "pylm", "--batches", "pylm=8/x"]) == 2
    assert "--batches 'pylm=8/x': expected TASK=VALUE" in capsys.readouterr().err
    assert main(["bench", "adaptive", "--tasks", "pylm", "--best-lrs", "pylm=8:0.002/32"]) == 2
    assert "--best-lrs 'pylm=8:0.002/32': expected TASK=VALUE" in capsys.readouterr().err
    assert main(["bench", "adaptive", "--tasks", "pylm", "--best-lrs", "pylm=32:0.003/8:0.002"]) == 2
    assert "--best-lrs pylm=32/8: expected distinct global batches, smallest first" in capsys.readouterr().err
    assert main(["bench", "adaptive", "--tasks", "pylm", "--best-lrs", "pylm=8:0.002", "--lrs", "pylm=0.1"]) == 2
    assert "--best-lrs pylm=... replaces the grid and the batches" in capsys.readouterr().err
    assert main(["bench", "adaptive", "--tasks", "pylm", "--set", "optim.nope=1"]) == 2
    assert "unknown key optim.nope; allowed: clip_grad_norm" in capsys.readouterr().err


def test_bench_refuses_a_held_out_set_smaller_than_the_ranks(world, monkeypatch):
    import types

    from hvdtrain import tasks
    from hvdtrain.bench import adaptive as bench_adaptive

    task = types.SimpleNamespace(model=mlp(seed=1), train_set=blobs(n=32), eval_set=blobs(n=0),
                                 loss_fn=classification_loss)
    monkeypatch.setattr(tasks, "build_task", lambda cfg: task)
    with pytest.raises(ConfigError, match=f"digits: 0 held-out samples for {world.size} ranks"):
        bench_adaptive._one(world, Config(), "digits", 0, 4, 0.1, None, {"target": 0.1}, 1.0, 256)


def test_bench_summary_pairs_seeds_and_reports_samples_to_target():
    import json
    import types

    from hvdtrain.bench.adaptive import _summary

    def run(seed, mode, batch, time_s, evals, lr=0.1, reached=True):
        return {"seed": seed, "mode": mode, "variant": "default" if mode == "adaptive" else "", "start_batch": batch,
                "lr": lr, "reached": reached, "time_s": time_s, "evals": evals, "samples": evals * 64}

    world = types.SimpleNamespace(size=2)
    # B=64 is best by median (3.0 s); per seed adaptive takes 1.5x, 1.0x and 0.5x of it.
    runs = [run(0, "fixed", 8, 9.0, 9), run(0, "fixed", 8, 1.0, 9, lr=0.5), run(0, "fixed", 64, 2.0, 20),
            run(0, "adaptive", 8, 3.0, 15),
            run(1, "fixed", 8, 8.0, 8), run(1, "fixed", 64, 4.0, 40), run(1, "adaptive", 8, 4.0, 12),
            run(2, "fixed", 8, 7.0, 7), run(2, "fixed", 64, 1.0, 10), run(2, "adaptive", 8, 0.5, 11),
            run(3, "fixed", 8, 7.0, 7), run(3, "fixed", 64, 9.0, 90, reached=False), run(3, "adaptive", 8, 1.0, 9)]
    out = _summary(world, "digits", {"batches": [4, 32], "target": 0.1}, runs,
                   {4: (9.0, 0.1), 32: (2.0, 0.1)}, ["default"], 20.0)
    assert out["median_time_s"] == {"adaptive_default": 2.0, "fixed_8": 7.5, "fixed_64": 3.0}
    assert out["adaptive_vs_best_fixed_each_seed"] == {"default": [1.5, 1.0, 0.5]}
    assert out["adaptive_vs_start_batch_below"] == {"default": None}
    assert out["adaptive_vs_best_fixed"] == {"default": 2.0 / 3.0}
    # Seed 3's fixed run missed the target: it has no ratio, and the batch no median sample count.
    assert out["adaptive_vs_best_fixed_per_seed"] == {"default": 1.0}
    assert out["median_samples"] == {"adaptive_default": 736, "fixed_8": 480, "fixed_64": None}
    # A start batch that misses the target on most seeds has no median time, so no ratio.
    missed = [dict(r, reached=False) if r["start_batch"] == 8 and r["mode"] == "fixed" else r for r in runs]
    out = _summary(world, "digits", {"batches": [4, 32], "target": 0.1}, missed,
                   {4: (9.0, 0.1), 32: (2.0, 0.1)}, ["default"], 20.0)
    assert out["median_time_s"]["fixed_8"] is None and out["adaptive_vs_start_batch"] == {"default": None}
    # It took longer than the 20 s budget, so adaptive's 2.0 s is under 0.1x of it.
    assert out["adaptive_vs_start_batch_below"] == {"default": 0.1}
    # An adaptive run that missed gives no ratio either: JSON would print Infinity.
    lost = [dict(r, reached=False) if r["mode"] == "adaptive" else r for r in runs]
    out = _summary(world, "digits", {"batches": [4, 32], "target": 0.1}, lost,
                   {4: (9.0, 0.1), 32: (2.0, 0.1)}, ["default"], 20.0)
    assert out["adaptive_vs_best_fixed"] == {"default": None} and out["adaptive_vs_start_batch"] == {"default": None}
    assert out["adaptive_vs_best_fixed_each_seed"] == {"default": [None, None, None]}
    assert "Infinity" not in json.dumps(out)


def test_decayed_batch_follows_gamma_up_to_the_cap():
    from hvdtrain.adaptive.goodput import Limits, decayed_batch

    lim = Limits(ranks=2, base=8, max_batch=128, cap=16, min_k=1, hysteresis=0.0, max_growth=1.0, theta=0.0)
    assert [decayed_batch(lim, 0.25, d) for d in range(4)] == [(4, 1), (16, 1), (16, 4), (16, 4)]
    one = Limits(ranks=1, base=4, max_batch=64, cap=64, min_k=2, hysteresis=0.0, max_growth=1.0, theta=0.0)
    assert decayed_batch(one, 0.5, 1) == (4, 2)  # one rank keeps two micro-batches for the noise scale


def test_step_schedule_multiplies_by_gamma_at_each_milestone():
    from hvdtrain.config import OptimConfig
    from hvdtrain.optim import LRSchedule

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = LRSchedule(opt, OptimConfig(lr=1.0, schedule="step", milestones="3,5", gamma=0.5), 1, 1, 10)
    assert [sched.multiplier(s) for s in range(7)] == [1, 1, 1, 0.5, 0.5, 0.25, 0.25]


def test_adam_preconditioner_caps_elements_adam_has_not_seen_yet():
    from hvdtrain.adaptive.gns import FLOOR_WEIGHT, GradNormMeter

    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 4)
    opt = torch.optim.Adam(emb.parameters(), lr=1e-3)
    emb(torch.tensor([0, 1, 2])).sum().backward()  # rows 3..9 get no gradient: v̂ stays 0 there
    opt.step()
    weights = GradNormMeter(emb.parameters(), opt, precondition=True)._preconditioner()[id(emb.weight)].double()
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
            want = meter._preconditioner()  # what a rebuild now would give: the frozen one it replaced matches
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


def test_step_time_model_prices_tiny_micro_batches_by_the_measured_fixed_cost():
    # Measured: 9.5 ms at m=4, 13.3 at 8, 72 at 64 (pylm, 4 December). A least-squares line through
    # these has its intercept near 0 and priced 64 micro-batches of 1 like 2 of 32.
    times = goodput.StepTimeModel({4: 0.0095, 8: 0.0133, 64: 0.072}, sync=0.005)
    assert times.micro_time(8) == 0.0133
    assert times.micro_time(1) == 0.0095  # no cheaper than the smallest measured micro-batch
    assert times.step_time(1, 64) > 3 * times.step_time(32, 2)
    assert times.micro_time(32) == pytest.approx(0.0133 + (0.072 - 0.0133) / 56 * 24)
    # Equal goodput (alpha = 0, same B): not the last bit but the running split decides, and where
    # the running micro-batch is not a candidate size, the largest micro-batch.
    flat = goodput.StepTimeModel({4: 0.4, 8: 0.8})
    assert goodput.decide(limits(hysteresis=0.0), flat, 1e6, (4, 2), [1, 2, 4, 8]) == (4, 2)
    assert goodput.decide(limits(hysteresis=0.0), flat, 1e6, (4, 2), [1, 2, 8]) in {(8, 1), (8, 2)}


def test_reshape_for_a_new_world_keeps_the_batch_where_the_size_divides_it():
    assert goodput.reshape(96, 2, 32, 1, 384) == (24, 2)  # 48 a rank, micro-batches of at most 32
    assert goodput.reshape(192, 3, 32, 1, 384) == (32, 2)  # 64 a rank
    assert goodput.reshape(128, 3, 64, 1, 384) == (43, 1)  # 128 / 3: the nearest, 129
    assert goodput.reshape(384, 1, 64, 2, 256) == (64, 4)  # capped at B_max; one rank keeps k >= 2
    assert goodput.reshape(8, 4, 4, 1, 64) == (2, 1)


def test_a_checkpoint_from_another_world_size_keeps_its_batch_and_probes_again():
    # An elastic run at 2 ranks checkpoints B = 64; a relaunch on 1 rank (same B0 = 16) resumes it.
    from hvdtrain.comm.reducer import GradReducer

    def controller(world, batch_size):
        cfg = Config(adaptive=AdaptiveConfig(enabled=True, max_batch=64), train=TrainConfig(batch_size=batch_size))
        model = mlp()
        return AdaptiveController(world, cfg, model, torch.optim.SGD(model.parameters(), lr=0.1),
                                  GradReducer(world, model.named_parameters()),
                                  ShardedBatchSampler(192, world, batch_size), blobs(n=192), classification_loss,
                                  lambda *a: True)

    saved = controller(fake_world(0, 2), 8)
    saved._apply(16, 2)
    saved.probed = True
    resumed = controller(fake_world(0, 1), 16)
    resumed.load_state_dict(saved.state_dict())
    assert (resumed.m, resumed.k, resumed.batch) == (16, 4, 64)  # not 1 x 16 x 2 = 32
    assert resumed.sampler.global_batch == 64 and not resumed.probed
