"""The batch-policy seam: what the loop asks about batches, and the fixed-batch policy.

The loop (hvdtrain/loop.py) iterates the policy's steps, asks it for each step's lr, runs each step
with its hooks (hvdtrain/step.py), retries a step's samples as it re-splits them, tells it each
step is done, and asks how far the run has come and whether evaluation is due. The fixed batch is
the trivial policy; adaptive batch sizing (hvdtrain/adaptive/controller.py) is the other.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Protocol

from torch.utils.data import Dataset

from hvdtrain.data import ShardedBatchSampler, train_loader
from hvdtrain.metrics import TrainLog
from hvdtrain.optim import LRSchedule
from hvdtrain.state import Resumable
from hvdtrain.step import NO_HOOKS, StepHooks


class BatchPolicy(Protocol):
    """Every method is called by all ranks at the same point of the run, and returns the same on each."""

    @property
    def hooks(self) -> StepHooks:
        """Added to every attempt at a step."""

    @property
    def base(self) -> int:
        """The starting global batch: the run's step count and the lr scale are counted against it."""

    def batches(self) -> Iterable[list[Any]]:
        """This rank's micro-batches, step by step, for the rest of the sampler's epoch."""

    def set_lr(self, schedule: LRSchedule, step: int) -> float:
        """Set the optimizer's lr for optimizer step `step` (0-based); returns the first group's."""

    def retry_after_oom(self) -> list[Any]:
        """The same step's samples, split into smaller micro-batches, after a RETRY."""

    def after_step(self, step: int, log: TrainLog) -> None:
        """Step `step` (1-based) is done and its samples counted; a batch change applies from the next."""

    def progress(self, step: int) -> float:
        """How many steps of `base` the run has made, after `step` optimizer steps."""

    def eval_due(self, step: int, every: int) -> bool:
        """Whether `train.eval_every` = `every` asks for an evaluation after step `step`."""

    def parts(self) -> dict[str, Resumable]:
        """Its state to checkpoint and commit, by name."""

    def finish(self) -> None:
        """After the last step: nothing left in flight."""

    def close(self) -> None:
        """On every exit path of the loop: detach whatever it hooked."""


class FixedBatch:
    """The global batch stays ranks x train.batch_size x train.accumulation (or an elastic run's
    first world's): the sampler's shape never changes, and progress is the step count."""

    hooks = NO_HOOKS

    def __init__(self, sampler: ShardedBatchSampler, dataset: Dataset) -> None:
        self.sampler, self.dataset = sampler, dataset

    @property
    def base(self) -> int:
        return self.sampler.global_batch

    def batches(self) -> Iterator[list[Any]]:
        group: list[Any] = []
        for batch in train_loader(self.dataset, self.sampler):
            group.append(batch)
            if len(group) == self.sampler.accumulation:
                yield group
                group = []

    def set_lr(self, schedule: LRSchedule, step: int) -> float:
        return schedule.apply(step)

    def retry_after_oom(self) -> list[Any]:
        raise AssertionError("a fixed-batch step is never retried: its hooks do not survive an OOM")

    def after_step(self, step: int, log: TrainLog) -> None:
        pass

    def progress(self, step: int) -> float:
        return step

    def eval_due(self, step: int, every: int) -> bool:
        return step % every == 0

    def parts(self) -> dict[str, Resumable]:
        return {}

    def finish(self) -> None:
        pass

    def close(self) -> None:
        pass
