"""One optimizer step over k micro-batches, and the hooks a batch policy adds to it.

Collective order of a step, identical on every rank: the gradient buckets the reducer launches
during the last micro-batch's backward (and whatever the hooks start beside them before the wait),
then the reducer's wait. The step's verdict (take it, skip it, retry its samples) is computed from
values every rank holds alike after that wait, so ranks cannot diverge on it.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hvdtrain.comm.reducer import HookedBuckets
from hvdtrain.common import batch_len, free_after_oom, is_oom, to_device
from hvdtrain.metrics import MetricSums
from hvdtrain.precision import Precision
from hvdtrain.profile.nvtx import nvtx_range
from hvdtrain.world import World

LossFn = Callable[[nn.Module, Any], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def classification_loss(model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Cross-entropy on (inputs, labels); reports accuracy (the default `loss_fn` of `fit`)."""
    x, y = batch
    logits = model(x)
    loss = F.cross_entropy(logits, y)
    return loss, {"accuracy": (logits.argmax(dim=1) == y).sum()}


def checked(result: Any, training: bool = False) -> tuple[torch.Tensor, dict[str, Any]]:
    """`loss_fn`'s result, or a TypeError that says what it must return (a mistake there otherwise
    surfaces deep in autograd or the metrics allreduce)."""
    if not (isinstance(result, tuple) and len(result) == 2):
        raise TypeError(f"loss_fn must return (loss, {{metric: batch sum}}), got {type(result).__name__}")
    loss, sums = result
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        got = f"shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise TypeError(f"loss_fn's loss must be a one-element tensor (the batch's mean loss), got {got}")
    if training and not loss.requires_grad:
        raise TypeError("loss_fn's loss does not require grad: compute it from the model's output, "
                        "without .item(), .detach() or torch.no_grad()")
    if not isinstance(sums, dict):
        raise TypeError(f"loss_fn's metrics must be a dict {{name: batch sum}}, got {type(sums).__name__}")
    return loss, sums


class Outcome(enum.Enum):
    STEPPED = "stepped"  # the averaged gradient was applied
    SKIPPED = "skipped"  # not finite on any rank: weights and optimizer state untouched on all
    RETRY = "retry"  # some rank ran out of memory: every rank runs the same samples again


class StepFlags:
    """What every rank must know of every rank after each attempt at a step: a stop was asked for
    (a signal on any rank, hvdtrain/stop.py), a rank ran out of memory. One named allreduce of two
    fp32 values with Average, started just before the gradient wait: Horovod fuses it with the last
    uncompressed bucket (under a compressed codec it is a small round of its own). One rank: no
    collective."""

    NAME = "hvdtrain.step.flags"

    def __init__(self, world: World, stop_requested: Callable[[], bool] = lambda: False) -> None:
        self.world, self.stop_requested = world, stop_requested
        self.stop = self.oom = False  # the last attempt's, the same on every rank
        self._handle: Any = None
        self._local = (False, False)

    def start(self, oom: bool) -> None:
        """All ranks call, before waiting on the gradient buckets."""
        self._local = (self.stop_requested(), oom)
        if self.world.size > 1:
            values = torch.tensor([float(v) for v in self._local], dtype=torch.float32)
            self._handle = self.world.allreduce_async(values, name=self.NAME, op="average")

    @property
    def local_oom(self) -> bool:
        """This rank ran out of memory in the last attempt."""
        return self._local[1]

    def settle(self, values: list[float]) -> list[float]:
        """Agree at once, instead of start/collect: the stop flag and `values` (each summed over
        all ranks) in one blocking allreduce; sets `stop` (and `oom` False) and returns the sums.
        All ranks must call with as many values."""
        local = [float(self.stop_requested()), *values]
        total = self.world.allreduce(torch.tensor(local, dtype=torch.float64), name=self.NAME + ".settle",
                                     op="sum") if self.world.size > 1 else torch.tensor(local, dtype=torch.float64)
        self.stop, self.oom = bool(total[0] > 0.5), False
        self._local = (bool(local[0]), False)
        return [float(v) for v in total[1:]]

    def collect(self) -> None:
        """After the bucket wait (by then the fused round is done): set `stop` and `oom`."""
        if self._handle is None:
            self.stop, self.oom = self._local
            return
        total = self.world.wait(self._handle) * self.world.size  # flags summed over ranks
        self._handle = None
        self.stop, self.oom = bool(total[0] > 0.5), bool(total[1] > 0.5)


class StepHooks:
    """What a batch policy adds to each attempt at a step; this base adds nothing. Every method is
    called on every rank at the same point of the attempt."""

    survives_oom = False  # True: an OOM in forward/backward is caught, and the attempt still syncs (NaN)

    def attempt_begins(self) -> None:
        """Before the attempt's first micro-batch."""

    def micro_batch_begins(self, j: int) -> None:
        """Before micro-batch j's forward (inside the OOM guard)."""

    def before_sync(self, reducer: HookedBuckets, oom: bool) -> None:
        """After the last backward (or an OOM on this rank), before waiting on the gradient buckets:
        collectives started here are negotiated with the buckets. A rank that ran out of memory
        sends NaN in the buckets it has left, so its peers' collectives complete and no partial
        gradient can ever be applied."""
        if oom:
            reducer.launch_rest(fill=math.nan)

    def after_sync(self, reducer: HookedBuckets, finite: bool) -> Outcome:
        """The verdict, from the reducer's `finite` (the same on every rank); an OOM on any rank
        turns it into RETRY whatever this says."""
        return Outcome.STEPPED if finite else Outcome.SKIPPED


NO_HOOKS = StepHooks()


def _no_beat(phase: str, collective: bool) -> None:
    pass


def train_step(model: nn.Module, optimizer: Any, reducer: HookedBuckets, micro_batches: list[Any],
               loss_fn: LossFn, sums: MetricSums, clip: float, device: torch.device,
               beat: Callable[[str, bool], None] = _no_beat, rank_samples: float | None = None,
               precision: Precision | None = None, hooks: StepHooks = NO_HOOKS,
               flags: StepFlags | None = None) -> Outcome:
    """One attempt at an optimizer step over k micro-batches; the reducer averages gradients as the
    k-th backward produces them. SKIPPED leaves weights and optimizer state alone; RETRY (some rank
    ran out of memory, known to all through `flags`) also leaves `sums` and the loss scale alone.
    All ranks must call.

    `rank_samples` (global batch / ranks): each micro-batch's mean loss is weighted by its size over
    it, which keeps the average exact when shares are uneven; None: equal micro-batches, weight 1/k."""
    precision = precision or _FP32
    if hooks.survives_oom and flags is None:
        raise ValueError("hooks that survive an OOM need StepFlags: every rank must learn of it")
    hooks.attempt_begins()
    losses, oom = [], False
    try:
        for j, batch in enumerate(micro_batches):
            beat(f"forward/backward of micro-batch {j} (loss_fn)", False)
            # Armed first: a fault the hooks raise at the micro-batch's start (an injected OOM) finds
            # the reducer already counting this micro-batch (ZeRO-3's replay needs to know which).
            reducer.arm(last_micro_batch=j == len(micro_batches) - 1, left=len(micro_batches) - 1 - j)
            hooks.micro_batch_begins(j)
            batch = to_device(batch, device)
            with precision.forward():
                loss, batch_sums = checked(loss_fn(model, batch), training=True)
            n = batch_len(batch)
            divisor = rank_samples / n if rank_samples else len(micro_batches)
            precision.backward(loss / divisor if divisor != 1 else loss)  # no autograd node for a no-op
            losses.append((loss, batch_sums, n))
    except Exception as exc:  # noqa: BLE001 - anything but an OOM the hooks handle is re-raised
        if not (hooks.survives_oom and is_oom(exc)):
            raise
        del exc  # the traceback holds the activations
        oom, losses = True, []
        free_after_oom(model, device)
    beat("gradient allreduce (hvdtrain.grad.*)", True)
    hooks.before_sync(reducer, oom)
    if flags is not None:
        flags.start(oom)
    with nvtx_range("allreduce wait"):
        finite = reducer.synchronize()
    if flags is not None:
        flags.collect()
    outcome = hooks.after_sync(reducer, finite)
    if flags is not None and flags.oom:
        reducer.zero_grad(optimizer)
        return Outcome.RETRY
    for loss, batch_sums, n in losses:
        sums.add(loss, batch_sums, n)
    # Horovod's mixed-precision order: synchronize, then unscale, clip and step without re-reducing.
    # Only unscaling and clipping touch every parameter; walking the module tree each step for
    # nothing cost ~0.02 ms of a 2.3 ms digits step.
    params = list(model.parameters()) if clip > 0 or precision.scaler is not None else []
    precision.step(optimizer, params, outcome is Outcome.STEPPED, clip, reducer)
    reducer.zero_grad(optimizer)  # GradReducer zeroes its buckets in place: the grads are their views
    return outcome


_FP32 = Precision()  # stateless in fp32: one for every call that passes no precision
