"""The memory probe: the largest micro-batch that fits and the smallest one that runs (almost) as
fast per sample as the best.

The probe runs before step 1 on every rank together: optimizer state is materialised first (a size
found without it OOMs at the first real step), memory is measured at two micro-batch sizes and
fitted as mem(m) = a + c·m, the predicted largest m (less a safety margin) is verified with a real
step and bisected on failure. Every rank runs the same sizes in the same order: each trial's verdict
(an OOM on any rank, the most bytes any rank held) is agreed in one small allreduce before the next
size is chosen, since under ZeRO-3 a trial's forward and backward are themselves collectives (the
parameter allgathers, the gradient reduce-scatters), which a rank trying another size would leave
waiting. The agreement costs one 3-value allreduce a trial (~15 trials); its third value says a rank
raised something other than an OOM, so every rank raises instead of the others waiting for a trial
that rank never runs. On GPU memory is the allocator's
peak and an OOM is real; on CPU it is what the step holds (parameters, gradients, optimizer state and
the tensors autograd saves for backward) against a budget, and the fault injector
(hvdtrain/faults.py) raises a real `torch.OutOfMemoryError` so the failure path runs on CPU too.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from hvdtrain.common import free_after_oom, is_oom, num_samples, rng_state, set_rng_state, to_device
from hvdtrain.config import AdaptiveConfig
from hvdtrain.errors import HvdtrainError
from hvdtrain.faults import FaultInjector
from hvdtrain.step import checked
from hvdtrain.world import World


@dataclass
class ProbeResult:
    cap: int  # largest micro-batch that fits (verified), agreed across ranks
    preferred: int  # smallest probed m within 5% of the best per-sample throughput
    seconds: dict[int, float]  # forward+backward seconds per micro-batch, by m (this rank)


class _Measure:
    """Bytes a step holds: allocator peak on GPU; on CPU, model state plus the tensors autograd saves."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        self.model, self.optimizer, self.cuda = model, optimizer, device.type == "cuda"
        self.saved: dict[int, int] = {}

    def _pack(self, x: torch.Tensor) -> torch.Tensor:
        storage = x.untyped_storage()
        self.saved[storage.data_ptr()] = storage.nbytes()
        return x

    def run(self, fn: Callable[[], None]) -> int:
        self.saved.clear()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            fn()
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated()
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda x: x):
            fn()
        return self._state_bytes() + sum(self.saved.values())

    def _state_bytes(self) -> int:
        """The distinct storages of the parameters, the optimizer's parameters (ZeRO's slices), their
        gradients and the optimizer state: views into one flat buffer count once, and ZeRO-3's
        parameters, whose gathered storage is freed between uses, count what they hold now (0)."""
        params = [*self.model.parameters(), *(p for g in self.optimizer.param_groups for p in g["params"])]
        tensors = params + [p.grad for p in params if p.grad is not None]
        tensors += [v for s in self.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        storages = {(t.device, t.untyped_storage().data_ptr()): t.untyped_storage().nbytes() for t in tensors}
        return sum(n for (_, ptr), n in storages.items() if ptr)


def budget_bytes(cfg: AdaptiveConfig, device: torch.device) -> int:
    if device.type == "cuda":
        return int(cfg.memory_fraction * torch.cuda.get_device_properties(device).total_memory)
    if cfg.memory_budget_mb:
        return int(cfg.memory_budget_mb * 2**20)
    import psutil

    return int(cfg.memory_fraction * psutil.virtual_memory().available)


class Prober:
    """Runs probe steps outside training, on every rank together. The caller has disarmed the
    reducer's gradient collectives; those a trial cannot do without (ZeRO-3's) are the reducer's to
    settle after each trial (`reducer.probe_trial_done`)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, dataset: Dataset, loss_fn: Any,
                 device: torch.device, injector: FaultInjector, world: World | None = None,
                 reducer: Any = None) -> None:
        self.world, self.model, self.optimizer, self.dataset = world, model, optimizer, dataset
        self.loss_fn, self.device, self.injector, self.reducer = loss_fn, device, injector, reducer
        self.measure = _Measure(model, optimizer, device)
        self.seconds: dict[int, float] = {}
        self.runs: dict[int, int] = {}  # successful runs by m

    def _batch(self, m: int) -> Any:
        n = num_samples(self.dataset)
        return to_device(default_collate([self.dataset[i % n] for i in range(m)]), self.device)

    def step(self, m: int, update: bool = False) -> int | None:
        """The most bytes one forward+backward of m samples held on any rank, or None if it ran out
        of memory (real or injected) on any rank. All ranks must call with the same m."""
        batch = self._batch(m)

        def fn() -> None:
            self.injector.check(m)
            loss, _ = checked(self.loss_fn(self.model, batch), training=True)
            loss.backward()

        used: int | None = None
        elapsed = 0.0
        error: Exception | None = None
        try:
            start = time.perf_counter()
            used = self.measure.run(fn)
            # The fastest of the runs at this size: the first pays allocation, and on a shared host any
            # one run can be stretched by a neighbour; a single slow sample priced a size out of every
            # later decision, since the controller only re-times the micro-batch it runs.
            elapsed = time.perf_counter() - start
        except Exception as exc:  # noqa: BLE001 - an OOM is a result; anything else is raised below
            if is_oom(exc):
                del exc  # the traceback holds the activations
                free_after_oom(self.model, self.device)
            else:
                error = exc  # raised after the agreement: the peers are waiting in it
        if self.reducer is not None:
            self.reducer.probe_trial_done(oom=used is None)
        used, elsewhere = self._agree(used, error is not None)
        if error is not None:
            raise error
        if elsewhere:
            raise HvdtrainError(f"the memory probe failed on another rank at micro-batch {m} (not out of "
                                "memory); that rank's output has the error")
        if used is not None:
            self.seconds[m] = min(elapsed, self.seconds.get(m, float("inf")))
            self.runs[m] = self.runs.get(m, 0) + 1
            if update:
                self.optimizer.step()  # materialises optimizer state before anything is measured
        self.optimizer.zero_grad()
        # The model's own gradients too: under ZeRO the optimizer's are slices, and a probe's
        # gradient left in `.grad` would be added to the first real step's.
        self.model.zero_grad(set_to_none=True)
        return used

    def _agree(self, used: int | None, error: bool) -> tuple[int | None, bool]:
        """[failed, bytes, error] maximised over ranks: (None if any rank failed, else the most
        bytes; whether any rank raised something other than an OOM)."""
        if self.world is None or self.world.size == 1:
            return used, False
        local = torch.tensor([1.0 if used is None else 0.0, float(used or 0), float(error)], dtype=torch.float64)
        failed, most, errors = self.world.allreduce(local, name="hvdtrain.adaptive.probe.trial", op="max").tolist()
        return (None if failed > 0 else int(most)), errors > 0

    def largest(self, start: int, limit: int, budget: int, margin: float) -> int:
        """Fit mem(m) = a + c·m at two sizes, predict, verify, bisect on failure."""
        self.step(min(start, limit), update=True)
        m1, m2 = min(start, limit), min(2 * start, limit)
        b1 = self.step(m1)
        if b1 is None:
            return self._bisect(0, m1)
        b2 = self.step(m2) if m2 > m1 else None
        if m2 == m1 or b2 is None:
            return m1 if m2 == m1 else self._bisect(m1, m2)
        c = max((b2 - b1) / (m2 - m1), 1.0)
        predicted = int((budget * (1 - margin) - (b1 - c * m1)) / c)
        guess = max(m1, min(limit, predicted))
        if guess == m2 or self.step(guess) is not None:
            return guess
        return self._bisect(m2, guess)

    def _bisect(self, good: int, bad: int) -> int:
        """Largest m in (good, bad) that runs; `good` is known to fit (0: none yet)."""
        while bad - good > 1:
            mid = (good + bad) // 2
            if self.step(mid) is None:
                bad = mid
            else:
                good = mid
        return max(good, 1)

    def preferred(self, cap: int, start: int) -> int:
        """Smallest m within 5% of the best per-sample time among start·2^i ≤ cap and cap."""
        sizes = sorted({min(cap, start * 2**i) for i in range(8)})
        for m in sizes:
            # Three runs a size, the fastest counting (the first pays allocation); those the memory
            # search already made count, which spares a third of the probe's time when it ran the cap.
            for _ in range(3 - self.runs.get(m, 0)):
                self.step(m)
        per_sample = {m: self.seconds[m] / m for m in sizes if m in self.seconds}
        best = min(per_sample.values())
        return min(m for m, t in per_sample.items() if t <= best * 1.05)


def probe(world: World, cfg: AdaptiveConfig, prober: Prober, start: int, limit: int) -> ProbeResult:
    """Run the probe on every rank together; every trial's verdict is agreed, so every rank finds
    the same cap. All ranks must call."""
    model, optimizer = prober.model, prober.optimizer
    # What a probe step can change: the tensors the optimizer steps (ZeRO's slices: ZeRO-3's
    # parameters are views into freed buffers, with nothing to copy), the model's buffers (batch
    # norm statistics), the optimizer's state and the RNGs.
    tensors = [p for g in optimizer.param_groups for p in g["params"]] + list(model.buffers())
    saved = ([t.detach().clone() for t in tensors], copy.deepcopy(optimizer.state_dict()), rng_state())
    try:
        # The smallest budget of any rank (free memory differs per host): the sizes tried next follow
        # from it, and every rank must try the same ones.
        budget = world.allreduce(torch.tensor([float(budget_bytes(cfg, prober.device))], dtype=torch.float64),
                                 name="hvdtrain.adaptive.probe.budget", op="min") if world.size > 1 else None
        cap = prober.largest(start, limit, int(budget[0]) if budget is not None else budget_bytes(cfg, prober.device),
                             cfg.probe_margin)
        preferred = prober.preferred(cap, min(start, cap))
    finally:
        with torch.no_grad():
            for t, value in zip(tensors, saved[0]):
                t.copy_(value)
        optimizer.load_state_dict(saved[1])
        set_rng_state(saved[2])
        optimizer.zero_grad()
    # Timings differ per rank: rank 0's choice holds for all.
    preferred = int(world.broadcast_object(preferred, name="hvdtrain.adaptive.probe.preferred"))
    return ProbeResult(cap, min(preferred, cap), dict(prober.seconds))
