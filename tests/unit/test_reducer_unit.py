"""The reducer's finiteness verdict: cheap when all is well, exact when it is not."""

import torch

from hvdtrain.comm.reducer import all_finite


def test_all_finite_agrees_with_the_elementwise_check():
    big = torch.full((8,), 3e38)  # every value finite, their float32 sum overflows to inf
    cases = [
        [torch.randn(100), torch.randn(7)],
        [big],
        [torch.randn(100), torch.tensor([1.0, float("inf")])],
        [torch.tensor([float("nan"), 1.0])],
        [big, torch.tensor([-float("inf")])],
        [torch.tensor([float("inf"), -float("inf")])],  # sums to NaN: still non-finite
    ]
    for flats in cases:
        assert all_finite(flats) == all(bool(torch.isfinite(f).all()) for f in flats), flats
    assert all_finite([]) is True


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))


def test_grads_stay_bucket_views_and_steps_match_plain_pytorch():
    """One rank: the reducer keeps each .grad a view of its bucket and zeroes the buckets in place;
    with two micro-batches accumulated every step, the weights still equal plain PyTorch's."""
    from hvdtrain.comm.reducer import GradReducer
    from hvdtrain.metrics import MetricSums
    from hvdtrain.step import Outcome, train_step
    from hvdtrain.world import World

    world = World(0, 1, 0, 1, torch.device("cpu"))
    ours, ref = _model(), _model()
    opt = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    reducer = GradReducer(world, ours.named_parameters(), bucket_mb=1e-4)  # several buckets

    def loss_fn(model, batch):
        x, y = batch
        return torch.nn.functional.cross_entropy(model(x), y), {}

    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        micro = [(torch.randn(4, 6, generator=gen), torch.randint(0, 3, (4,), generator=gen)) for _ in range(2)]
        assert train_step(ours, opt, reducer, micro, loss_fn, MetricSums(), 0.0, world.device) is Outcome.STEPPED
        ref_opt.zero_grad()
        for batch in micro:
            (loss_fn(ref, batch)[0] / 2).backward()
        ref_opt.step()
    assert len(reducer.buckets) > 1
    for b, params in enumerate(reducer.buckets):
        for p, view in zip(params, reducer.views(b)):
            assert p.grad.data_ptr() == view.data_ptr() and not p.grad.any()
    for a, b in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_a_grad_rebound_elsewhere_is_copied_in_and_becomes_a_view_again():
    from hvdtrain.comm.reducer import GradReducer
    from hvdtrain.world import World

    model = _model()
    reducer = GradReducer(World(0, 1, 0, 1, torch.device("cpu")), model.named_parameters())
    model(torch.randn(2, 6)).sum().backward()
    assert reducer.synchronize()
    reducer.zero_grad()
    first = next(model.parameters())
    first.grad = torch.ones_like(first)  # e.g. a user's hook or another optimizer rebinding it
    model(torch.randn(2, 6)).sum().backward()  # accumulates onto the ones, as PyTorch would
    expected = first.grad.clone()
    assert reducer.synchronize()
    torch.testing.assert_close(first.grad, expected)
    assert any(first.grad.data_ptr() == v.data_ptr() for b in range(len(reducer.buckets)) for v in reducer.views(b))
