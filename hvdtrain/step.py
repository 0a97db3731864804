"""One optimizer step over k micro-batches, and the hooks a batch policy adds to it.

Collective order of a step, identical on every rank: the gradient buckets the reducer launches
during the last micro-batch's backward (and whatever the hooks start beside them before the wait),
then the reducer's wait. The step's verdict (take it, skip it, retry its samples) is computed from
values every rank holds alike after that wait, so ranks cannot diverge on it.
"""

from __future__ import annotations

import enum
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

LossFn = Callable[[nn.Module, Any], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def classification_loss(model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Cross-entropy on (inputs, labels); reports accuracy (the default `loss_fn` of `fit`)."""
    x, y = batch
    logits = model(x)
    loss = F.cross_entropy(logits, y)
    return loss, {"accuracy": (logits.argmax(dim=1) == y).sum()}


class Outcome(enum.Enum):
    STEPPED = "stepped"  # the averaged gradient was applied
    SKIPPED = "skipped"  # not finite on any rank: weights and optimizer state untouched on all
    RETRY = "retry"  # some rank ran out of memory: every rank runs the same samples again


class StepHooks:
    """What a batch policy adds to each attempt at a step; this base adds nothing. Every method is
    called on every rank at the same point of the attempt."""

    survives_oom = False  # True: an OOM in forward/backward is caught, and the attempt still syncs

    def attempt_begins(self) -> None:
        """Before the attempt's first micro-batch."""

    def micro_batch_begins(self, j: int) -> None:
        """Before micro-batch j's forward (inside the OOM guard)."""

    def before_sync(self, reducer: HookedBuckets, oom: bool) -> None:
        """After the last backward (or an OOM on this rank), before waiting on the gradient buckets:
        collectives started here are negotiated with the buckets."""

    def after_sync(self, reducer: HookedBuckets, finite: bool) -> Outcome:
        """The verdict, from the reducer's `finite` (the same on every rank)."""
        return Outcome.STEPPED if finite else Outcome.SKIPPED


NO_HOOKS = StepHooks()


def _no_beat(phase: str, collective: bool) -> None:
    pass


def train_step(model: nn.Module, optimizer: Any, reducer: HookedBuckets, micro_batches: list[Any],
               loss_fn: LossFn, sums: MetricSums, clip: float, device: torch.device,
               beat: Callable[[str, bool], None] = _no_beat, rank_samples: float | None = None,
               precision: Precision | None = None, hooks: StepHooks = NO_HOOKS) -> Outcome:
    """One attempt at an optimizer step over k micro-batches; the reducer averages gradients as the
    k-th backward produces them. SKIPPED leaves weights and optimizer state alone; RETRY also leaves
    `sums` alone. All ranks must call.

    `rank_samples` (global batch / ranks): each micro-batch's mean loss is weighted by its size over
    it, which keeps the average exact when shares are uneven; None: equal micro-batches, weight 1/k."""
    precision = precision or _FP32
    hooks.attempt_begins()
    losses, oom = [], False
    try:
        for j, batch in enumerate(micro_batches):
            beat(f"forward/backward of micro-batch {j} (loss_fn)", False)
            hooks.micro_batch_begins(j)
            reducer.arm(last_micro_batch=j == len(micro_batches) - 1)
            batch = to_device(batch, device)
            with precision.forward():
                loss, batch_sums = loss_fn(model, batch)
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
    with nvtx_range("allreduce wait"):
        outcome = hooks.after_sync(reducer, reducer.synchronize())
    if outcome is Outcome.RETRY:
        reducer.zero_grad(optimizer)
        return outcome
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
