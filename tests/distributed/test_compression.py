"""Gradient codecs under horovodrun at any world size (and plainly, as size 1)."""

import dataclasses

import pytest
import torch
from helpers import Crash, blobs, crashing_fit, flat_params, mlp, shared_tmpdir, small_config, train_digits

import hvdtrain
from hvdtrain.checkpoint import load_checkpoint
from hvdtrain.comm.compression import BF16, FP16, Codec
from hvdtrain.comm.reducer import GradReducer
from hvdtrain.config import CheckpointConfig, CommConfig
from hvdtrain.tasks import classification_loss


def reduce_with(codec, t, name):
    pending = codec.launch(t.clone(), name)
    codec.advance(pending)
    return codec.finish(pending)


def test_plain_horovod_fp16_overflows_where_safe_fp16_does_not(world):
    import horovod.torch as hvd

    if world.size < 2:
        pytest.skip("the fp16 sum overflows only when at least two ranks add 4e4")
    grad = torch.full((1000,), 4e4)
    # Horovod's Compression.fp16: cast, then Average, which sums in fp16 before dividing.
    compressed, ctx = hvd.Compression.fp16.compress(grad)
    plain = hvd.Compression.fp16.decompress(hvd.allreduce(compressed, op=hvd.Average, name="t.plain"), ctx)
    assert torch.isinf(plain).all()
    safe = reduce_with(FP16(world), grad, "t.safe")
    assert torch.equal(safe, grad)


def test_bf16_reduce_equals_fp32_reduce_to_bf16_precision(world):
    g = torch.Generator().manual_seed(world.rank)
    t = torch.randn(10_001, generator=g) * (1 + world.rank)  # odd length: exercises the padding
    exact = reduce_with(Codec(world), t, "t.fp32")
    approx = reduce_with(BF16(world), t, "t.bf16")
    # Each input is rounded to bf16 (unit roundoff 2^-8), summed in fp32, and the mean rounded again.
    every = torch.stack(world.allgather_object(t, name="t.inputs"))
    bound = 2**-8 * (every.abs().mean(0) + exact.abs()) + 1e-30
    assert ((approx - exact).abs() <= bound * 1.01).all()
    assert not torch.equal(approx, exact)  # it really went through bf16


def test_fp16_in_chunks_matches_one_collective_and_reuses_its_buffers(world):
    g = torch.Generator().manual_seed(100 + world.rank)
    t = torch.randn(10_001, generator=g)  # odd length: the last chunk is short
    whole = FP16(world)
    chunked = FP16(world)
    chunked.chunk_bytes = 4 * 1024  # 1024 values per chunk: 10 full chunks and a short one
    one = reduce_with(whole, t, "t.fp16.whole")
    pending = chunked.launch(t.clone(), "t.fp16.chunks", want_sent=True)
    assert len(pending.chunks) == 10
    assert torch.equal(pending.sent, t.div(world.size).half().float() * world.size)
    many = chunked.finish(pending)
    if world.size <= 2:  # a sum of two is exact in either order
        assert torch.equal(many, one)
    else:  # the ring adds a chunk's values in an order that depends on where the chunk starts
        assert torch.allclose(many, one, rtol=2**-9, atol=2**-20)
    every = torch.stack(world.allgather_object(t, name="t.fp16.inputs"))
    # n roundings to fp16 (unit roundoff 2^-11), each of at most the mean of |inputs|, plus subnormals.
    bound = world.size * (2**-11 * every.abs().mean(0) + 2**-24)
    assert ((many - every.mean(0)).abs() <= bound * 1.01).all()
    staged = chunked._staging["t.fp16.chunks"]
    again = reduce_with(chunked, t, "t.fp16.chunks")
    assert chunked._staging["t.fp16.chunks"] is staged and torch.equal(again, many)


def test_error_feedback_carries_the_residual(world):
    # 1e-8 / n underflows fp16 (smallest subnormal ~6e-8): without feedback it never arrives.
    steps, g = 100, 1e-8

    def run(feedback):
        p = torch.nn.Parameter(torch.zeros(4))
        reducer = GradReducer(world, [("p", p)], "fp16", error_feedback=feedback)
        total = torch.zeros(4)
        for _ in range(steps):
            p.grad = torch.full((4,), g)
            assert reducer.synchronize()
            total += p.grad
        reducer.remove()
        return total, reducer

    without, _ = run(False)
    with_ef, reducer = run(True)
    assert torch.equal(without, torch.zeros(4))
    quantum = 2**-24 * world.size  # one fp16 subnormal step, undone by the pre-division
    assert ((with_ef - steps * g).abs() <= quantum).all()
    assert set(reducer.state_dict()["residuals"]) == {"0"}


def test_inf_on_one_rank_skips_the_same_step_everywhere(world):
    bad_step = 3

    def loss_fn(model, batch):
        loss, sums = classification_loss(model, batch)
        loss_fn.calls += 1
        if world.rank == world.size - 1 and loss_fn.calls == bad_step:
            loss = loss * float("inf")  # only this rank's gradient becomes inf/nan
        return loss, sums

    loss_fn.calls = 0
    cfg = small_config(epochs=1, accumulation=1)
    cfg = dataclasses.replace(cfg, comm=CommConfig(compression="fp16"))
    model = mlp(seed=3)
    result = hvdtrain.fit(world, model, None, blobs(), cfg, loss_fn=loss_fn)
    skipped = world.allgather_object(result.skipped, name="t.skipped")
    assert skipped == [1] * world.size
    events = [r for r in result.history if r["kind"] == "event" and r["event"] == "skip"]
    assert [e["step"] for e in events] == [bad_step]
    final = world.allgather_object(flat_params(model), name="t.params")
    assert all(torch.equal(final[0], f) for f in final) and torch.isfinite(final[0]).all()


@pytest.mark.parametrize("mode", ["fp16", "bf16", "auto"])
def test_digits_accuracy_within_half_a_point_of_no_compression(world, digits_baseline, mode):
    result = train_digits(world, f"comm.compression={mode}", "comm.auto_steps=2")
    assert result.eval["accuracy"] >= digits_baseline - 0.005, (mode, result.eval["accuracy"], digits_baseline)
    if mode == "auto":
        chosen = [r for r in result.history if r.get("event") == "compression"]
        assert len(chosen) == 1 and chosen[0]["choice"] in ("none", "fp16")
        assert set(chosen[0]["median_step_ms"]) == {"none", "fp16"}


def test_fp16_average_above_the_fp16_range_travels_again_in_fp32(world):
    # Every rank sends 1e5 (its share 1e5 / n fits fp16, the average 1e5 does not): the fp16 sum is
    # inf on every rank alike, and the codec resends those values in fp32.
    codec = FP16(world)
    big = torch.full((1000,), 1e5) + torch.arange(1000.0)
    pending = codec.launch(big.clone(), "t.fp16.big", want_sent=True)
    out = codec.finish(pending)
    assert torch.equal(out, big) and codec.fallbacks == 1
    # The wire carried the fp32 values: nothing left over for error feedback (n is a power of two
    # here or the division rounds by at most one ulp).
    torch.testing.assert_close(pending.sent, big, rtol=2**-23, atol=0)
    small = torch.full((10,), 3.0)
    assert torch.equal(reduce_with(codec, small, "t.fp16.small"), small) and codec.fallbacks == 1


class Scaled(torch.nn.Module):
    """A linear model whose gradients are ~1e5 per element: loss = 1e5 * mean(output)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(8)
        self.lin = torch.nn.Linear(12, 3)

    def forward(self, x):
        return self.lin(x)


def scaled_loss(model, batch):
    x, _ = batch
    return model(x).sum(dim=1).mean() * 1e5, {}  # the bias gradient is 1e5 per element on every rank


@pytest.mark.parametrize("feedback", [False, True])
def test_fit_with_fp16_applies_steps_whose_average_overflows_fp16(world, feedback):
    cfg = small_config(epochs=1, accumulation=1)
    # lr small enough that steps of 1e5-sized gradients stay finite; plain SGD keeps the update linear.
    cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, lr=1e-7, momentum=0.0))
    runs = {}
    for codec in ("none", "fp16"):
        model = Scaled()
        c = dataclasses.replace(cfg, comm=CommConfig(compression=codec, error_feedback=feedback and codec == "fp16"))
        runs[codec] = (hvdtrain.fit(world, model, None, blobs(), c, loss_fn=scaled_loss), flat_params(model))
    (result, got), (_, want) = runs["fp16"], runs["none"]
    assert result.skipped == 0 and not any(r.get("event") == "skip" for r in result.history)
    # The bias gradient (1e5) and most weight gradients overflow fp16 and go in fp32 (equal up to the
    # order of fp32 sums); the rest go in fp16 (its rounding, 2^-11 relative).
    torch.testing.assert_close(got, want, rtol=2**-10, atol=1e-6)


def test_error_feedback_residuals_survive_a_skipped_step(world):
    p = torch.nn.Parameter(torch.zeros(4))
    reducer = GradReducer(world, [("p", p)], "fp16", error_feedback=True)
    p.grad = torch.full((4,), 1e-8)  # underflows fp16: all of it stays in the residual
    assert reducer.synchronize()
    before = reducer.state_dict()["residuals"]["0"].clone()
    assert (before != 0).all()
    p.grad = torch.full((4,), float("nan") if world.rank == 0 else 1.0)
    assert not reducer.synchronize()  # skipped on every rank
    assert torch.equal(reducer.state_dict()["residuals"]["0"], before)  # still owed, bitwise
    reducer.remove()


def test_error_feedback_residuals_restored_bitwise_after_resume(world):
    folder = shared_tmpdir(world)
    base = small_config(epochs=2, shuffle=True, batch_size=2, accumulation=1)
    base = dataclasses.replace(base, comm=CommConfig(compression="fp16", error_feedback=True))

    def run(name, crash_at=None, resume=""):
        ck = CheckpointConfig(dir=f"{folder}/{name}", every=20, resume=resume)
        return crashing_fit(world, blobs(n=160), dataclasses.replace(base, checkpoint=ck), seed=2, crash_at=crash_at)

    whole_model, whole = run("whole")
    try:
        run("crashed", crash_at=27)  # dies 7 steps after the checkpoint at step 20
    except Crash:
        pass
    else:
        raise AssertionError("the run should have crashed")
    resumed_model, resumed = run("crashed", resume="latest")
    assert resumed.history[0]["resumed_from"].endswith("step_00000020")
    last = [load_checkpoint(f"{folder}/{name}/step_{whole.step:08d}") for name in ("whole", "crashed")]
    residuals = [[r["reducer"]["residuals"] for r in c["ranks"]] for c in last]
    assert residuals[0][0] and all(set(a) == set(b) for a, b in zip(*residuals))
    if world.size <= 2:  # a two-rank sum is order-free, so the runs repeat bit for bit (see test_training)
        assert torch.equal(flat_params(resumed_model), flat_params(whole_model))
        assert all(torch.equal(a[k], b[k]) for a, b in zip(*residuals) for k in a)
