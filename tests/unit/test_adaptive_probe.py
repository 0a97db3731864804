"""The memory probe and the OOM backstop's arithmetic (one process, injected OOMs)."""


import pytest
import torch
from helpers import blobs, mlp

from hvdtrain.adaptive.probe import Prober
from hvdtrain.common import is_oom, shrink_after_oom
from hvdtrain.config import Config, FaultsConfig
from hvdtrain.errors import TrainingStopped
from hvdtrain.faults import FaultInjector
from hvdtrain.tasks import classification_loss


def test_probe_bisects_to_the_injected_limit_and_respects_a_memory_budget():
    cfg = FaultsConfig(oom_above=11)
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    prober = Prober(model, opt, blobs(n=64), classification_loss, torch.device("cpu"), FaultInjector(cfg, 0))
    assert prober.largest(start=2, limit=64, budget=2**30, margin=0.1) == 11
    assert prober.injector.raised >= 1 and opt.state  # the optimizer state was materialised first
    free = Prober(model, opt, blobs(n=64), classification_loss, torch.device("cpu"), FaultInjector(FaultsConfig(), 0))
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
    injector = FaultInjector(FaultsConfig(), 0)
    prober = Prober(model, opt, blobs(n=64), classification_loss, torch.device("cpu"), injector)
    for _ in range(3):
        prober.step(4)
    assert prober.seconds[4] == 1.0  # not the last (3 s) nor the first, allocating one (5 s)


def test_probe_times_each_size_three_times_counting_the_memory_search_runs():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prober = Prober(model, opt, blobs(n=64), classification_loss, torch.device("cpu"),
                    FaultInjector(FaultsConfig(), 0))
    assert prober.largest(4, 16, 2**40, 0.1) == 16  # runs 4 (twice), 8 and 16
    assert prober.runs == {4: 2, 8: 1, 16: 1}
    prober.preferred(16, 4)
    assert prober.runs == {4: 3, 8: 3, 16: 3}


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
