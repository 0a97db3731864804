"""Adaptive batch sizing under horovodrun at any world size (and plainly, as size 1)."""

import dataclasses
import re

import pytest
import torch
from helpers import Crash, blobs, crashing_fit, flat_params, mlp, shared_tmpdir, small_config
from torch.utils.data import Dataset

import hvdtrain
from hvdtrain.adaptive.probe import Prober, probe
from hvdtrain.config import AdaptiveConfig, CheckpointConfig, FaultsConfig
from hvdtrain.errors import HvdtrainError
from hvdtrain.faults import FaultInjector
from hvdtrain.tasks import classification_loss


class Indexed(Dataset):
    """blobs() whose samples also carry their index, so tests can see which samples each step used."""

    def __init__(self, n):
        self.data = blobs(n=n)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        x, y = self.data[i]
        return x, y, i


def recording_loss(log):
    def loss_fn(model, batch):
        x, y, idx = batch
        log.append(idx.tolist())
        return classification_loss(model, (x, y))
    return loss_fn


def adaptive_config(batch_size=8, accumulation=2, epochs=1, **adaptive):
    """`oom_*` keys go to the faults section, the rest to the adaptive one."""
    faults = {k: adaptive.pop(k) for k in list(adaptive) if k.startswith("oom_")}
    cfg = small_config(epochs=epochs, batch_size=batch_size, accumulation=accumulation, shuffle=True)
    cfg = dataclasses.replace(cfg, faults=FaultsConfig(**faults))
    base = {"enabled": True, "probe": False, "warmup_steps": 10**6}
    # lr for the global batch itself, so splitting it differently keeps the same lr
    optim = dataclasses.replace(cfg.optim, lr_scaling="none", lr=0.2)
    return dataclasses.replace(cfg, optim=optim, adaptive=AdaptiveConfig(**{**base, **adaptive}))


def _union(world, micro_batches, name):
    every = world.allgather_object(sorted(i for mb in micro_batches for i in mb), name=f"t.adaptive.{name}")
    return sorted(i for r in every for i in r)


def adaptive_records(history):
    return [r for r in history if r["kind"] == "adaptive"]


def test_oom_on_one_rank_retries_same_samples_with_same_batch_and_lr(world):
    data = Indexed(192)
    oom_step = 3
    injected = adaptive_config(oom_above=4, oom_rank=world.size - 1, oom_step=oom_step)
    seen = []
    model = mlp(seed=2)
    result = hvdtrain.fit(world, model, None, data, injected, loss_fn=recording_loss(seen))
    # Reference: the smaller micro-batch from the start, no fault.
    reference_model = mlp(seed=2)
    ref_seen = []
    reference = hvdtrain.fit(world, reference_model, None, data, adaptive_config(batch_size=4, accumulation=4),
                             loss_fn=recording_loss(ref_seen))
    got, want = adaptive_records(result.history), adaptive_records(reference.history)
    assert [r["ooms"] for r in got][oom_step - 1:oom_step + 1] == [0, 1]  # the step after `oom_step` hit it
    assert [(r["m"], r["k"]) for r in got[oom_step:]] == [(4, 4)] * (len(got) - oom_step)
    assert [r["B"] for r in got] == [r["B"] for r in want]  # the global batch never changed
    lrs = lambda h: [r["lr"] for r in h if r["kind"] == "train"]  # noqa: E731
    assert lrs(result.history) == lrs(reference.history)  # nor did the LR
    # The failed attempt (size-8 micro-batches after the first oom_step steps) and the retry (the first
    # size-4 ones) drew from the same global batch, which is the reference's batch at that step.
    big, small = [i for i in seen if len(i) == 8], [i for i in seen if len(i) == 4]
    failed = _union(world, big[2 * oom_step:], "failed")
    retried = _union(world, small[:4], "retried")
    assert failed and set(failed) <= set(retried)
    assert retried == _union(world, ref_seen[4 * oom_step:4 * oom_step + 4], "reference")
    assert result.step == reference.step
    torch.testing.assert_close(flat_params(model), flat_params(reference_model), rtol=1e-5, atol=1e-6)


def test_oom_mid_backward_after_buckets_left_still_skips_on_every_rank(world):
    # One micro-batch a step and a bucket per tensor: half the buckets are on the wire when the
    # OOM hits, and the held last one carries the NaN that tells every rank to skip and retry.
    def config(**overrides):
        cfg = adaptive_config(**overrides)
        return dataclasses.replace(cfg, comm=dataclasses.replace(cfg.comm, bucket_mb=1e-6))

    data, oom_step = Indexed(192), 3
    per_rank = 8 if world.size > 1 else 16  # one rank alone runs k >= 2 (as 8 x 2)
    injected = config(batch_size=per_rank, accumulation=1, oom_above=4, oom_rank=world.size - 1,
                      oom_step=oom_step, oom_in="backward")
    model, reference_model = mlp(seed=4), mlp(seed=4)
    result = hvdtrain.fit(world, model, None, data, injected, loss_fn=recording_loss([]))
    reference = hvdtrain.fit(world, reference_model, None, data, config(batch_size=4, accumulation=per_rank // 4),
                             loss_fn=recording_loss([]))
    got, want = adaptive_records(result.history), adaptive_records(reference.history)
    assert [r["ooms"] for r in got][oom_step - 1:oom_step + 1] == [0, 1]
    assert [(r["m"], r["k"]) for r in got[oom_step:]] == [(4, per_rank // 4)] * (len(got) - oom_step)
    assert [r["B"] for r in got] == [r["B"] for r in want] and result.step == reference.step
    assert not any(r.get("event") == "skip" for r in result.history)  # retried, not skipped
    torch.testing.assert_close(flat_params(model), flat_params(reference_model), rtol=1e-5, atol=1e-6)


def growing_config(batch_size=2, **overrides):
    # theta = 0.1 puts the norm-test floor at 100x the noise scale, above B_max: every decision grows
    # the batch as far as allowed, whatever the timings. How a batch splits into (m, k) still follows
    # the measured step times unless max_micro_batch leaves one micro-batch size.
    settings = {"warmup_steps": 2, "decide_every": 2, "max_batch": 16 * 4, "norm_test": 0.1, "max_micro_batch": 4,
                "smoothing": 0.9, **overrides}
    return adaptive_config(batch_size=batch_size, accumulation=2, **settings)


def test_decisions_same_step_on_every_rank_and_no_sample_lost_or_repeated(world):
    data, seen = Indexed(160 * world.size), []
    cfg = growing_config(max_micro_batch=0)
    result = hvdtrain.fit(world, mlp(seed=3), None, data, cfg, loss_fn=recording_loss(seen))
    changes = [(r["step"], r["m"], r["k"], r["new"]) for r in result.history if r.get("event") == "batch"]
    every = world.allgather_object(changes, name="t.adaptive.decisions")
    assert len(changes) >= 2 and all(c == changes for c in every)
    assert changes[-1][3] > 4 * world.size  # the batch grew
    used = _union(world, seen, "samples")
    records = adaptive_records(result.history)
    assert len(used) == len(set(used)) == sum(r["B"] for r in records)  # one epoch: each sample once
    # Only a remainder smaller than the batch in force after the last step is left.
    next_batch = changes[-1][3] if changes[-1][0] == records[-1]["step"] else records[-1]["B"]
    assert len(data) - len(used) < next_batch


def test_probe_agrees_on_the_smallest_cap_when_one_rank_fails_above_it(world):
    cfg = AdaptiveConfig(enabled=True, memory_budget_mb=256)
    faults = FaultsConfig(oom_above=6, oom_rank=world.size - 1)
    model = mlp(seed=6)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    before = flat_params(model).clone()
    prober = Prober(model, optimizer, blobs(n=64), classification_loss, world.device,
                    FaultInjector(faults, world.rank), world)
    result = probe(world, cfg, prober, start=2, limit=32)
    every = world.allgather_object((result.cap, result.preferred), name="t.adaptive.probe")
    assert all(e == (6, every[0][1]) for e in every) and 1 <= result.preferred <= 6
    assert torch.equal(flat_params(model), before) and not optimizer.state  # the probe left no trace


def test_probe_raises_on_every_rank_when_one_rank_fails_otherwise(world):
    # An error that is not an OOM on one rank: that rank raises it, the others a line pointing at it,
    # after the trial's agreement, so no rank is left waiting in a collective the failed rank skips.
    bad = world.size - 1

    def loss(model, batch):
        if world.rank == bad and len(batch[1]) > 4:
            raise ValueError("a label out of range")
        return classification_loss(model, batch)

    model = mlp(seed=6)
    prober = Prober(model, torch.optim.Adam(model.parameters(), lr=1e-3), blobs(n=64), loss, world.device,
                    FaultInjector(FaultsConfig(), world.rank), world)
    with pytest.raises(Exception) as info:
        probe(world, AdaptiveConfig(enabled=True, memory_budget_mb=256), prober, start=2, limit=32)
    if world.rank == bad:
        assert info.type is ValueError
    else:
        found = re.fullmatch(r"the memory probe failed on another rank at micro-batch (\d+) \(not out of "
                             r"memory\); that rank's output has the error", str(info.value))
        assert info.type is HvdtrainError and found and int(found[1]) > 4, info.value
    world.barrier()  # every rank is past the probe's collectives


@pytest.mark.parametrize("stop", [4, 5])  # 4: a decision step, its broadcast still in flight at the checkpoint
def test_resume_restores_the_controller_exactly(world, stop):
    data, folder = blobs(n=96 * world.size), shared_tmpdir(world)
    # m = 1 only, so the two runs' shapes cannot part on timing noise: on a loaded CI host one run
    # split B=32 as (4, 4) and the other as (2, 8), and the comparison below failed.
    base = growing_config(epochs=3, batch_size=1, max_micro_batch=1)

    def run(cfg, crash_at=None):
        return crashing_fit(world, data, cfg, seed=5, crash_at=crash_at)

    whole_model, whole = run(base)
    ck = CheckpointConfig(dir=f"{folder}/ck", every=stop)
    try:
        run(dataclasses.replace(base, checkpoint=ck), crash_at=40)
    except Crash:
        pass
    else:
        raise AssertionError("the run should have crashed")
    resumed_model, resumed = run(dataclasses.replace(base, checkpoint=dataclasses.replace(ck, resume="latest")))
    assert resumed.history[0]["resumed_from"].endswith(f"step_{stop:08d}")
    keys = ("m", "k", "B", "progress", "g2", "trace", "lr_factor")
    pick = lambda h: [(r["step"], *(r[k] for k in keys)) for r in adaptive_records(h)]  # noqa: E731
    after = [r for r in pick(whole.history) if r[0] > stop]
    assert pick(resumed.history) == after and len({r[3] for r in after}) > 1  # the batch kept changing
    torch.testing.assert_close(flat_params(resumed_model), flat_params(whole_model), rtol=0, atol=0)


def test_eval_every_counts_starting_batches_of_samples_as_the_batch_grows(world):
    cfg = growing_config(max_micro_batch=0)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, eval_every=3))
    result = hvdtrain.fit(world, mlp(seed=3), None, Indexed(160 * world.size), cfg,
                          eval_set=Indexed(16), loss_fn=recording_loss([]))
    records = adaptive_records(result.history)
    assert records[-1]["B"] >= 4 * records[0]["B"]  # the batch grew, so steps and samples part ways
    period, seen, want = 3 * records[0]["B"], 0, []
    for r in records:
        if (seen + r["B"]) // period > seen // period:
            want.append(r["step"])
        seen += r["B"]
    evals = [r["step"] for r in result.history if r["kind"] == "eval"]
    assert evals == want and len(evals) >= 3


def test_evaluation_runs_at_the_micro_batch_in_force(world):
    cfg = growing_config(max_micro_batch=0, probe=True)  # probe timings let m grow, not only k
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, eval_every=3))
    evals, was_training = [], True

    def loss_fn(model, batch):
        nonlocal was_training
        if not model.training:
            if was_training:
                evals.append([])
            evals[-1].append(len(batch[1]))
        was_training = model.training
        return classification_loss(model, batch[:2])

    result = hvdtrain.fit(world, mlp(seed=3), None, Indexed(160 * world.size), cfg,
                          eval_set=Indexed(64 * world.size), loss_fn=loss_fn)
    m_after = {r["step"]: r["m"] for r in adaptive_records(result.history)}
    m_after.update({r["step"]: r["m"] for r in result.history if r.get("event") == "batch"})  # from the next step
    steps = [r["step"] for r in result.history if r["kind"] == "eval"]
    assert len(steps) == len(evals) >= 3
    assert all(sum(sizes) == 64 and sizes[0] == min(m_after[s], 64) for s, sizes in zip(steps, evals)), (steps, evals)
    assert max(s[0] for s in evals) > cfg.train.batch_size  # the micro-batch grew, and evaluation with it


def test_decay_to_batch_turns_each_lr_decay_into_batch_growth_until_the_cap(world):
    # Smith et al.: B0 = ranks x 2 x 2; lr x0.5 at progress 4, 8 and 12 (steps of B0) becomes B x2,
    # up to B_max = 4 B0, where the third decay stays in the lr.
    cfg = adaptive_config(batch_size=2, accumulation=2, epochs=3, max_batch=16 * world.size)
    cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, schedule="step", milestones="4,8,12",
                                                             gamma=0.5),
                              adaptive=dataclasses.replace(cfg.adaptive, policy="decay_to_batch"))
    result = hvdtrain.fit(world, mlp(seed=4), None, Indexed(96 * world.size), cfg, loss_fn=recording_loss([]))
    b0 = 4 * world.size
    got = [(r["step"], r["B"] // b0) for r in adaptive_records(result.history)][:9]
    assert got == [(1, 1), (2, 1), (3, 1), (4, 1), (5, 2), (6, 2), (7, 4), (8, 4), (9, 4)]
    lrs = [r["lr"] for r in result.history if r["kind"] == "train"][:9]
    assert lrs[:7] == [0.2] * 7  # each decay so far was taken as batch growth
    assert lrs[7:] == [0.1, 0.1]  # at the cap B grew x4 of the x8 asked: half of the third decay stays in the lr
    changes = [(r["step"], r["new"]) for r in result.history if r.get("event") == "batch"]
    every = world.allgather_object(changes, name="t.adaptive.decays")
    assert all(c == changes for c in every)


def test_step_stats_apply_a_step_late_resume_where_they_would_and_a_non_finite_step_at_once(world):
    from hvdtrain.adaptive.gns import NoiseScale
    from hvdtrain.adaptive.goodput import StepTimeModel
    from hvdtrain.adaptive.stats import StepStats

    def fresh():
        noise = NoiseScale(0.9, 8)
        return StepStats(world, noise, StepTimeModel({})), noise

    stats, noise = fresh()
    for step in range(3):  # a few steps so the averages have history
        handle = stats.start(4.0 + step + world.rank, 0.02, 0.005, 0.001)
        stats.settle(handle, True, 1.5, m=4, k=2)
    before = noise.state_dict()
    saved = stats.state_dict()  # the third step's stats, waited on but not applied
    assert noise.state_dict() == before and saved is not None
    stats.collect()
    assert noise.state_dict() != before and 4 in stats.times.micro
    resumed, resumed_noise = fresh()
    resumed_noise.load_state_dict(before)
    resumed.load_state_dict(saved)
    resumed.collect()
    assert resumed_noise.state_dict() == noise.state_dict()
    # A non-finite average (an overflow, or NaN from a rank that ran out of memory) is collected at once.
    handle = stats.start(0.0, 0.02, 0.005, 0.001)
    stats.settle(handle, False, None, m=4, k=2)
    assert stats.pending is None


def test_step_flags_bring_one_ranks_oom_or_stop_request_to_every_rank_at_once(world):
    from hvdtrain.step import StepFlags

    asked = [False]
    flags = StepFlags(world, lambda: asked[0])
    flags.start(oom=world.rank == world.size - 1)  # the last rank ran out of memory
    flags.collect()
    assert flags.oom and not flags.stop
    asked[0] = world.rank == 0  # a stop signal on rank 0 only
    flags.start(oom=False)
    flags.collect()
    assert flags.stop and not flags.oom
    asked[0] = False
    flags.start(oom=False)
    flags.collect()
    assert not flags.stop and not flags.oom  # an overflow is not an OOM: nothing is flagged


def test_step_stats_carry_every_ranks_sums_in_fp32_and_keep_an_overflowed_norm_out(world):
    from hvdtrain.adaptive.gns import NoiseScale
    from hvdtrain.adaptive.goodput import StepTimeModel
    from hvdtrain.adaptive.stats import StepStats

    noise = NoiseScale(0.9, 8)
    stats = StepStats(world, noise, StepTimeModel({}))
    local = 123456.789 * (1 + world.rank / 7)  # not representable in fp32
    handle = stats.start(local, 0.02 + world.rank * 1e-3, 0.005, 0.001)
    stats.settle(handle, True, 1.5, m=4, k=2)
    sums = stats.state_dict()[0]
    n = world.size
    assert sums[0] == pytest.approx(sum(123456.789 * (1 + r / 7) for r in range(n)), rel=1e-6)
    assert sums[1] == pytest.approx(sum(0.02 + r * 1e-3 for r in range(n)), rel=1e-6)
    stats.collect()
    assert noise.updates == 1
    # A local norm past fp32's range arrives as inf: the step's average decides the step, and the
    # estimators and step times skip it.
    before, times = noise.state_dict(), stats.times.state_dict()
    handle = stats.start(1e39 if world.rank == 0 else 1.0, 0.02, 0.005, 0.001)
    stats.settle(handle, True, 1.5, m=4, k=2)
    stats.collect()
    assert noise.state_dict() == before and stats.times.state_dict() == times


def test_adam_second_moment_follows_each_batch_change_identically_on_every_rank(world, monkeypatch):
    ratios = []

    def recording(optimizer, ratio):  # the rescales applied (a no-op call, ratio 1, is not one)
        done = rescale(optimizer, ratio)
        if done:
            ratios.append(ratio)
        return done

    rescale = hvdtrain.optim.rescale_second_moment
    monkeypatch.setattr(hvdtrain.optim, "rescale_second_moment", recording)

    def run(rescale_adam):
        cfg = growing_config(max_micro_batch=0, rescale_adam=rescale_adam)
        cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, name="adam", lr=1e-3))
        model = mlp(seed=7)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        result = hvdtrain.fit(world, model, optimizer, Indexed(160 * world.size), cfg, loss_fn=recording_loss([]))
        v = torch.cat([optimizer.state[p]["exp_avg_sq"].reshape(-1) for p in model.parameters()])
        return result, v, flat_params(model)

    result, v, params = run(True)
    changes = [(r["old"], r["new"], r["gns"]) for r in result.history if r.get("event") == "batch"]
    assert changes and len(ratios) == len(changes)
    assert [r["adam_v_scale"] for r in result.history if r.get("event") == "batch"] == ratios  # logged
    # Rank 0's noise scale, broadcast with the decision: every rank scales by the same factor, so
    # Adam's state, and so the weights, stay bitwise equal across ranks, and every rank's batch
    # event names that noise scale, not its own.
    every = world.allgather_object((ratios, v.tolist(), params.tolist(), changes), name="t.adaptive.adam_state")
    assert all(e[:3] == every[0][:3] for e in every)
    assert all(e[3] == every[0][3] for e in every)
    root_changes = every[0][3]
    assert ratios == [hvdtrain.adaptive.goodput.second_moment_ratio(phi, old, new) for old, new, phi in root_changes]
    assert all(r < 1 for r in ratios)  # the batch only grew: less noise in E[g²]
    _, kept, _ = run(False)
    assert len(ratios) == len(changes)  # off: no rescale at all
    assert v.sum() < kept.sum()


def test_a_decision_that_fails_on_rank_0_stops_every_rank_instead_of_hanging(world, monkeypatch):
    def broken(*args):
        raise ValueError("no candidate")

    monkeypatch.setattr(hvdtrain.adaptive.goodput, "decide", broken)  # only rank 0 calls it
    cfg = growing_config(max_micro_batch=0)
    with pytest.raises(RuntimeError, match="step 2: rank 0's batch decision failed"):
        hvdtrain.fit(world, mlp(seed=3), None, Indexed(64 * world.size), cfg, loss_fn=recording_loss([]))


def with_precision(cfg, precision):
    return dataclasses.replace(cfg, memory=dataclasses.replace(cfg.memory, precision=precision))


def test_fp16_oom_retry_keeps_the_loss_scale_and_matches_the_schedule_without_the_fault(world):
    # The OOM rank's NaN makes the average non-finite, but the flags turn that into a retry: the loss
    # scale is not halved, nothing is counted as skipped, and the run equals the fault-free one that
    # used the smaller micro-batch from the start. fp16 rounds each micro-batch's weight gradient, so
    # the two splits of the same samples differ by that rounding: atol 1e-3 (the weights are ~0.1-1).
    data, oom_step = Indexed(192), 3
    injected = with_precision(adaptive_config(oom_above=4, oom_rank=world.size - 1, oom_step=oom_step), "fp16")
    model, reference_model = mlp(seed=2), mlp(seed=2)
    result = hvdtrain.fit(world, model, None, data, injected, loss_fn=recording_loss([]))
    reference = hvdtrain.fit(world, reference_model, None, data,
                             with_precision(adaptive_config(batch_size=4, accumulation=4), "fp16"),
                             loss_fn=recording_loss([]))
    got = adaptive_records(result.history)
    assert [r["ooms"] for r in got][oom_step - 1:oom_step + 1] == [0, 1]
    assert result.skipped == 0 and not any(r.get("event") == "skip" for r in result.history)
    assert [r["B"] for r in got] == [r["B"] for r in adaptive_records(reference.history)]
    torch.testing.assert_close(flat_params(model), flat_params(reference_model), rtol=0, atol=1e-3)


def test_fp16_noise_scale_is_measured_unscaled_and_the_batch_grows(world):
    # The statistics see gradients times the loss scale (65536); undone, the noise scale matches the
    # fp32 run's, and the batch grows under fp16 as under fp32.
    data = Indexed(160 * world.size)
    runs = {}
    for precision in ("fp32", "fp16"):
        cfg = with_precision(growing_config(max_micro_batch=0), precision)
        result = hvdtrain.fit(world, mlp(seed=3), None, data, cfg, loss_fn=recording_loss([]))
        runs[precision] = result
    grew = {p: [r["new"] for r in res.history if r.get("event") == "batch"] for p, res in runs.items()}
    assert grew["fp16"] and grew["fp16"][-1] > 4 * world.size
    g2 = {p: [r["g2"] for r in adaptive_records(res.history) if r["g2"]] for p, res in runs.items()}
    assert g2["fp16"] and g2["fp32"]
    assert g2["fp16"][-1] == pytest.approx(g2["fp32"][-1], rel=0.05)


def test_zero3_probe_tries_the_same_sizes_on_every_rank_and_finds_the_unsharded_cap(world):
    # Under ZeRO-3 a probe trial's forward and backward are collectives: every rank tries the same
    # sizes (each verdict agreed), the rank whose trials above m = 6 run out of memory joins its
    # peers' gathers and reduce-scatters, the cap is the unsharded probe's, and training goes on
    # from weights the probe left untouched.
    reports, firsts = {}, {}
    for zero in (0, 3):
        cfg = growing_config(batch_size=2, max_micro_batch=0, probe=True, memory_budget_mb=256,
                             warmup_steps=10**6, oom_above=6, oom_rank=world.size - 1, oom_step=0)
        cfg = dataclasses.replace(cfg, memory=dataclasses.replace(cfg.memory, zero_stage=zero))
        result = hvdtrain.fit(world, mlp(seed=6), None, Indexed(32 * world.size), cfg, loss_fn=recording_loss([]))
        reports[zero] = [r for r in result.history if r.get("event") == "probe"]
        firsts[zero] = next(r["loss"] for r in result.history if r["kind"] == "train")
    every = world.allgather_object(reports[3][0]["cap"], name="t.adaptive.zero3.probe")
    assert every == [6] * world.size and reports[0][0]["cap"] == 6
    assert firsts[3] == pytest.approx(firsts[0], rel=1e-6)  # the first step started from the same weights


@pytest.mark.parametrize("stage,precision", [(1, "fp32"), (2, "fp32"), (3, "fp32"), (2, "fp16"), (3, "fp16")])
def test_zero_adaptive_grows_and_retries_an_oom_like_unsharded(world, stage, precision):
    # The same schedule with and without sharding: the batch grows at the same steps, the injected
    # OOM is retried at half the micro-batch, and the weights agree (a ring's summation order is the
    # only difference: rtol 1e-5). Stage 3: the rank that ran out of memory joins its peers'
    # remaining parameter allgathers and reduce-scatters.
    data = Indexed(160 * world.size)
    runs = {}
    for zero in (0, stage):
        cfg = growing_config(batch_size=8, max_micro_batch=0, oom_above=4, oom_rank=world.size - 1, oom_step=3)
        cfg = with_precision(cfg, precision)
        cfg = dataclasses.replace(cfg, memory=dataclasses.replace(cfg.memory, zero_stage=zero))
        model = mlp(seed=5)
        result = hvdtrain.fit(world, model, None, data, cfg, loss_fn=recording_loss([]))
        runs[zero] = (model, result)
    schedule = {z: [(r["step"], r["m"], r["k"], r["B"], r["ooms"]) for r in adaptive_records(res.history)]
                for z, (_, res) in runs.items()}
    assert schedule[stage] == schedule[0]
    assert schedule[0][-1][3] > schedule[0][0][3] and schedule[0][-1][4] >= 1  # grew, and an OOM was retried
    torch.testing.assert_close(flat_params(runs[stage][0]), flat_params(runs[0][0]), rtol=1e-5, atol=1e-6)
