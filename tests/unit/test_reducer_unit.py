"""The reducer's finiteness verdict: cheap when all is well, exact when it is not."""

import torch

from hvdtrain.reducer import _all_finite


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
        assert _all_finite(flats) == all(bool(torch.isfinite(f).all()) for f in flats), flats
    assert _all_finite([]) is True
