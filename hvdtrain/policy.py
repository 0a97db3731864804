"""The batch-policy seam: what the loop asks about batches, and the fixed-batch policy.

The loop (hvdtrain/loop.py) iterates the policy's steps, asks it for each step's lr, runs each step
with its hooks (hvdtrain/step.py), retries a step's samples as it re-splits them, tells it each
step is done, and asks how far the run has come and whether evaluation is due. The fixed batch is
the trivial policy; adaptive batch sizing (hvdtrain/adaptive/controller.py) is the other.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Protocol

from torch.utils.data import Dataset, default_collate

from hvdtrain.data import ShardedBatchSampler, train_loader
from hvdtrain.errors import TrainingStopped
from hvdtrain.faults import FaultInjector
from hvdtrain.metrics import TrainLog
from hvdtrain.optim import LRSchedule
from hvdtrain.state import Resumable
from hvdtrain.step import StepHooks


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

    def retry_after_oom(self, step: int) -> list[Any]:
        """The same step's samples (step `step`, 1-based), split into smaller micro-batches, after a
        RETRY; or TrainingStopped, the same on every rank."""

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


class FixedBatchHooks(StepHooks):
    """The fixed batch's part in each attempt: faults injected on purpose, and surviving an OOM, so
    that every rank learns of it at the same step and either retries it at a smaller micro-batch
    (train.on_oom=retry) or stops (stop); one rank raising alone would leave the others waiting."""

    survives_oom = True

    def __init__(self, sampler: ShardedBatchSampler, injector: FaultInjector) -> None:
        self.sampler, self.injector = sampler, injector

    def micro_batch_begins(self, j: int) -> None:
        self.injector.micro_batch_begins(self.sampler.micro_batch)


class FixedBatch:
    """The global batch stays ranks x train.batch_size x train.accumulation (or an elastic run's
    first world's), and progress is the step count. After an OOM on any rank (train.on_oom=retry)
    every rank re-runs the step's samples in micro-batches of half the size, for the rest of the
    run: the same samples, the same lr, the same weights but for the order of float sums."""

    def __init__(self, sampler: ShardedBatchSampler, dataset: Dataset, injector: FaultInjector,
                 on_oom: str = "retry", loader_options: dict[str, Any] | None = None) -> None:
        self.sampler, self.dataset, self.on_oom = sampler, dataset, on_oom
        # One loader for the run: its workers (data.persistent_workers) outlive an epoch.
        self.loader = train_loader(dataset, sampler, loader_options)
        self.hooks: StepHooks = FixedBatchHooks(sampler, injector)
        self._split: list[tuple[int, int]] = []  # (micro_batch, accumulation) after each OOM, to log
        self._restart = False

    @property
    def base(self) -> int:
        return self.sampler.global_batch

    def batches(self) -> Iterator[list[Any]]:
        epoch = self.sampler.epoch
        while self.sampler.epoch == epoch and not self.sampler.epoch_done:
            # An iteration reads the sampler's shape when it starts: after an OOM, a new one from here.
            self._restart = False
            group: list[Any] = []
            for batch in self.loader:
                group.append(batch)
                if len(group) == self.sampler.accumulation:
                    self.sampler.step_taken()
                    yield group
                    group = []
                    if self._restart:
                        break
            else:
                return

    def set_lr(self, schedule: LRSchedule, step: int) -> float:
        return schedule.apply(step)

    def retry_after_oom(self, step: int) -> list[Any]:
        """Half the micro-batch (at least 1) for the same global batch; this rank's share of the
        step's samples in micro-batches of that size. Every rank calls after the same RETRY."""
        m = self.sampler.micro_batch
        if self.on_oom == "stop":
            raise TrainingStopped(f"stopped at step {step}: out of memory at a micro-batch of {m} "
                                  "(train.on_oom=stop); lower train.batch_size and raise train.accumulation, "
                                  "or set train.on_oom=retry")
        if m == 1:
            raise TrainingStopped(f"stopped at step {step}: out of memory with a micro-batch of 1 sample "
                                  "(train.on_oom=retry); use a smaller model, memory.activation_checkpointing, "
                                  "memory.zero_stage or more memory")
        self.sampler.split(max(1, m // 2))
        self._split.append((self.sampler.micro_batch, self.sampler.accumulation))
        self._restart = True
        return [default_collate([self.dataset[i] for i in idx]) for idx in self.sampler.step_indices()]

    def after_step(self, step: int, log: TrainLog) -> None:
        for m, k in self._split:
            log.event(step, "oom", action="retried", micro_batch=m, accumulation=k)
            log.bar.write(f"hvdtrain: step {step}: out of memory on a rank; the step was retried on every rank "
                          f"in micro-batches of {m} (accumulation {k}), kept from now on")
        self._split = []

    def progress(self, step: int) -> float:
        return step

    def eval_due(self, step: int, every: int) -> bool:
        return step % every == 0

    def parts(self) -> dict[str, Resumable]:
        return {}

    def finish(self) -> None:
        pass

    def close(self) -> None:
        # Persistent workers end with the loader's iterator; without this, at interpreter exit.
        self.loader._iterator = None
