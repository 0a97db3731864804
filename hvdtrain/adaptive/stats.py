"""The adaptive controller's per-step statistics: one allreduce (never compressed) of [Σ local
|g_j|², compute s, previous step's sync s and rest s], started with the gradient buckets and
collected a step later. (Whether a rank ran out of memory travels in the loop's StepFlags.)

It travels as fp32 with Horovod's Average, like the uncompressed gradient buckets: Horovod fuses
tensors of one dtype and op negotiated in one cycle, so it rides in the last bucket's allreduce.
As an fp64 tensor it was a Gloo round of its own: 7.5 / 6.9 ms a step against 6.8 / 6.7 in fp32
(fixed batch: 6.0 / 6.4) at B = 128 on mnist1d, 2 ranks on 2 shared cores, medians of 6 and 8
alternated rounds; a Horovod timeline shows the fusion directly. The sums are formed in
fp64 on each rank; fp32 carries them with a relative error of ~1e-7. The estimators subtract
(|g_b|² against |g_B|²), so the |G|² estimate is off by ~1e-7 |g_b|²: 1e-4 of |G|² even at
φ/b = 1000, where one step's sampling noise is of the order of |g_b|² itself. Under a compressed
codec (fp16 buckets) it cannot fuse and is a round of its own.

Started before the bucket wait, Horovod negotiates it in the buckets' cycle (issued after them it
cost a round of its own, ~3 ms a step over Gloo on pylm). Collected at the next attempt, even an
unfused round runs behind the optimizer step and the next forward. Only a non-finite average (an
overflow, or NaN from a rank that ran out of memory) needs it at once, and every rank sees that
alike, so every rank waits at the same point.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from hvdtrain.adaptive.gns import NoiseScale
from hvdtrain.adaptive.goodput import StepTimeModel
from hvdtrain.world import World


@dataclass
class _Pending:
    handle: Any  # until waited on
    values: list[float] | None  # after
    finite: bool
    g2: float | None  # |ḡ|², taken before the optimizer step can change the gradients (clipping)
    m: int
    k: int
    ranks: int  # of the world that sent them: an elastic reset may apply them in another


class StepStats:
    """Feeds `noise` and `times` one step late."""

    def __init__(self, world: World, noise: NoiseScale, times: StepTimeModel) -> None:
        self.world, self.noise, self.times = world, noise, times
        self.pending: _Pending | None = None

    def start(self, local: float, compute: float, sync: float, rest: float) -> Any:
        """All ranks call, before waiting on the gradient buckets. The previous attempt's stats are
        collected first: Horovod refuses a second tensor of the same name while one is queued."""
        self.collect()
        values = torch.tensor([local, compute, sync, rest], dtype=torch.float32)
        return self.world.allreduce_async(values, name="hvdtrain.adaptive.stats", op="average")

    def settle(self, handle: Any, finite: bool, g2: float | None, m: int, k: int) -> None:
        """After the bucket wait: keep this attempt's stats for later, or collect them now if the
        average is not finite (an overflow, or a rank that ran out of memory sent NaN)."""
        self.pending = _Pending(handle, None, finite, g2, m, k, self.world.size)
        if not finite:
            self.collect()

    def collect(self) -> None:
        """Wait for (normally: pick up) the pending stats and apply them. Each rank on its own."""
        p, self.pending = self.pending, None
        if p is None:
            return
        total = self._sums(p)
        n = p.ranks
        # A local norm past fp32's range (inf) must not reach the estimators; the step itself is
        # judged by the gradient average, which every rank sees alike.
        if p.finite and all(math.isfinite(v) for v in total):
            if p.g2 is not None:
                count = n * p.k
                self.noise.update(total[0] / count, p.g2, count, p.m)
            self.times.record(p.m, total[1] / n / p.k, (total[2] + total[3]) / n)

    def state_dict(self) -> list | None:
        """The pending stats, unapplied: a resumed run applies them where this one will."""
        p = self.pending
        if p is None:
            return None
        return [self._sums(p), p.finite, p.g2, p.m, p.k, p.ranks]

    def _sums(self, p: _Pending) -> list[float]:
        """The ranks' sums, in fp64 (the allreduce averaged them in fp32)."""
        if p.values is None:
            p.values = [v * p.ranks for v in self.world.wait(p.handle).double().tolist()]
        return p.values

    def load_state_dict(self, state: list | None) -> None:
        if state and len(state) == 5:  # saved before the world size was; a checkpoint resume keeps it
            state = [*state, self.world.size]
        if state and len(state[0]) == 5:  # saved before 7 December: [local, oom flag, compute, sync, rest]
            state = [[v for i, v in enumerate(state[0]) if i != 1], *state[1:]]
        self.pending = _Pending(None, *state) if state else None
