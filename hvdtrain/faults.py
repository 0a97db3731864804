"""Faults injected on purpose (config section `faults`), so that tests and users can see what the
toolkit does about them: a real `torch.OutOfMemoryError` in forward or mid-backward on micro-batches
above a size, on one rank or all, from a given step on. Off (and free) unless `faults.oom_above`."""

from __future__ import annotations

import torch
from torch import nn

from hvdtrain.config import FaultsConfig


class FaultInjector:
    """`check(m, phase)` raises the injected OOM when armed; with a model attached, a backward of
    a micro-batch above the size raises halfway through, after the reducer may have launched its
    first buckets. `step` is the optimizer step about to run (the memory probe runs at step 0)."""

    def __init__(self, cfg: FaultsConfig, rank: int) -> None:
        self.above, self.phase = cfg.oom_above, cfg.oom_in
        self.enabled = cfg.oom_above > 0 and cfg.oom_rank in (-1, rank)
        self.from_step, self.step = cfg.oom_step, 0
        self.raised = 0
        self._hooks: list = []
        self._fired, self._halfway, self._m = 0, 0, 0

    def attach(self, model: nn.Module) -> None:
        """Count gradient hooks, to raise mid-backward (only when enabled and armed for backward)."""
        if not self.enabled or self.phase != "backward":
            return
        params = [p for p in model.parameters() if p.requires_grad]
        self._halfway = max(1, len(params) // 2)
        self._hooks = [p.register_hook(self._on_grad) for p in params]

    def detach(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def begin_step(self, step: int) -> None:
        """Optimizer step `step` (0-based) is about to run."""
        self.step = step

    def micro_batch_begins(self, m: int) -> None:
        """Before a micro-batch of m samples: a forward-phase OOM raises here."""
        self._fired, self._m = 0, m
        self.check(m, "forward")

    def _on_grad(self, grad: torch.Tensor) -> None:
        self._fired += 1
        if self._fired == self._halfway:
            self.check(self._m, "backward")

    def check(self, micro_batch: int, phase: str | None = None) -> None:
        """Raises the injected OOM if armed for `phase`; None (the probe, which times forward and
        backward as one measurement) matches either phase."""
        if (self.enabled and phase in (None, self.phase) and micro_batch > self.above
                and self.step >= self.from_step):
            self.raised += 1
            raise torch.OutOfMemoryError(f"injected OOM: micro-batch {micro_batch} > faults.oom_above="
                                         f"{self.above} at step {self.step}")
