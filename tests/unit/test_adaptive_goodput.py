"""The goodput model: lr rules, batch decisions, the step-time model, decayed batches, reshapes (pure arithmetic)."""

import math

import pytest
import torch

from hvdtrain.adaptive import goodput


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


def test_reshape_for_a_new_world_keeps_the_batch_where_the_size_divides_it():
    assert goodput.reshape(96, 2, 32, 1, 384) == (24, 2)  # 48 a rank, micro-batches of at most 32
    assert goodput.reshape(192, 3, 32, 1, 384) == (32, 2)  # 64 a rank
    assert goodput.reshape(128, 3, 64, 1, 384) == (43, 1)  # 128 / 3: the nearest, 129
    assert goodput.reshape(384, 1, 64, 2, 256) == (64, 4)  # capped at B_max; one rank keeps k >= 2
    assert goodput.reshape(8, 4, 4, 1, 64) == (2, 1)
