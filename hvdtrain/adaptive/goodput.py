"""Batch-size decisions from the noise scale and a throughput model (no collectives).

Statistical efficiency of a global batch B relative to the starting batch B0 is
E(B) = (φ + B0)/(φ + B) with φ the noise scale; AdaScale's gain r = (1 + φ/B0)/(1 + φ/B) = E·B/B0 is
how many B0-steps of progress one step at B is worth. Goodput = (B / step time) · E(B); the step time
of k micro-batches of m samples is modelled as k·t(m) + t_rest from measured timings.
"""

from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass, field
from typing import Any

from hvdtrain.common import largest_divisor
from hvdtrain.errors import ConfigError


def gain(phi: float, batch: int, base: int) -> float:
    """AdaScale gain r ∈ [1, B/B0]; before any estimate (nan) 1, when noise dominates (inf) B/B0."""
    if math.isnan(phi):
        return 1.0
    if math.isinf(phi):
        return batch / base
    r = (1 + phi / base) / (1 + phi / batch)
    return min(max(r, 1.0), batch / base)


def efficiency(phi: float, batch: int, base: int) -> float:
    return gain(phi, batch, base) * base / batch


def second_moment_ratio(phi: float, old: int, new: int) -> float:
    """E|g|² at global batch `new` over E|g|² at `old`: (|G|² + tr(Σ)/B) scales as 1 + φ/B. 1 before
    any estimate (nan); old/new when noise dominates (inf)."""
    if math.isnan(phi) or old == new:
        return 1.0
    if math.isinf(phi):
        return old / new
    return (1 + phi / new) / (1 + phi / old)


def lr_factor(rule: str, adam: bool, phi: float, batch: int, base: int) -> float:
    """LR multiplier on top of the user's schedule for global batch `batch`."""
    if rule == "adascale":
        r = gain(phi, batch, base)
        return math.sqrt(r) if adam else r
    return {"linear": batch / base, "sqrt": math.sqrt(batch / base), "none": 1.0}[rule]


@dataclass
class StepTimeModel:
    """Per-micro-batch seconds by m and the rest of a step (bucket wait, optimizer step, data): one
    number, paid once per step whatever k is.

    `micro` holds times measured in training (smoothed), `probed` the memory probe's, taken outside
    training: without the step's collectives running beside the backward and without the norm hooks,
    so faster (pylm, 2 ranks on 2 cores: m=16 33 ms probed, 41-45 ms in training; m=4 18 ms both).
    Compared raw, every size not yet run looked cheaper than the one running, and a decision could
    move to a size only to find it slower and move back. A size not run yet is therefore priced at
    its probe time times the training/probe ratio of the nearest size that has run."""

    micro: dict[int, float]
    sync: float = 0.0
    probed: dict[int, float] = field(default_factory=dict)

    def record(self, m: int, per_micro: float, sync: float, keep: float = 0.8) -> None:
        """One step's time at the running size m. Once m has run before, a change in its time is
        taken as the host's speed changing and every other size that has run follows by the same
        factor: only the running size is re-timed, and a size timed an hour ago on a host 1.5x
        faster (or slower) would otherwise win (or lose) every decision on stale numbers."""
        old = self.micro.get(m)
        if old is None:
            # The first sample of a size tells its cost, not the host's speed: nothing else moves.
            guess = self.micro_time(m) if self.probed else None
            self.micro[m] = per_micro if guess is None else _smooth(guess, per_micro, keep)
        else:
            self.micro[m] = _smooth(old, per_micro, keep)
            drift = self.micro[m] / old
            for s in self.micro:
                if s != m:
                    self.micro[s] *= drift
        self.sync = sync if self.sync == 0.0 else _smooth(self.sync, sync, keep)

    def record_probe(self, m: int, seconds: float) -> None:
        self.probed[m] = seconds

    def _table(self) -> dict[int, float]:
        table = dict(self.micro)
        ran = sorted(s for s in self.micro if s in self.probed)
        for s, t in self.probed.items():
            if s not in table:
                near = min(ran, key=lambda r: (abs(math.log(r / s)), r), default=None)
                table[s] = t * (self.micro[near] / self.probed[near] if near is not None else 1.0)
        return table

    def micro_time(self, m: int) -> float:
        """Seconds for one micro-batch of m: its time in training, else its calibrated probe time,
        else linear between the nearest such sizes, extended above the largest with the last
        segment's slope (a least-squares line through all sizes, before 4 December, could put the
        intercept at 0 and price 64 micro-batches of 1 like 2 of 32).

        Below the smallest known size a micro-batch costs what that size costs: the probe starts at
        the user's micro-batch and prefers the smallest within 5% of the best per-sample time, so
        smaller ones are never cheaper per sample. Extending the first segment down to m=1 once
        priced it at 3 ms against 7.6 ms measured (pylm; the segment's top end had been timed in a
        slow spell) and the controller ran (m, k) = (1, 9)."""
        table = self._table()
        if m in table:
            return table[m]
        ms = sorted(table)
        if not ms:
            return float(m)
        if m < ms[0]:
            return table[ms[0]]
        if len(ms) == 1:
            return table[ms[0]] * m / ms[0]  # one size seen: assume time proportional to m
        i = min(bisect.bisect_left(ms, m), len(ms) - 1)
        lo, hi = ms[i - 1], ms[i]
        slope = (table[hi] - table[lo]) / (hi - lo)
        return max(table[lo] + slope * (m - lo), 1e-12)

    def step_time(self, m: int, k: int) -> float:
        return k * self.micro_time(m) + self.sync

    def state_dict(self) -> dict[str, Any]:
        return {"micro": [[m, t] for m, t in sorted(self.micro.items())], "sync": self.sync,
                "probed": [[m, t] for m, t in sorted(self.probed.items())]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.micro = {int(m): float(t) for m, t in state["micro"]}
        self.sync = float(state["sync"])
        # Absent in older checkpoints, whose probe times sit in `micro`.
        self.probed = {int(m): float(t) for m, t in state.get("probed", [])}


def _smooth(old: float, new: float, keep: float) -> float:
    """Moving average that takes one step's time at no more than 2x (or 1/2) the average: a step
    stretched 10x by a neighbour on the host (or a collection pause) would otherwise move it 2.8x and
    price that micro-batch out of the next decision; a real change still gets through in a few steps."""
    return keep * old + (1 - keep) * min(max(new, old / 2), 2 * old)


class StepClock:
    """Splits a step's wall time into compute (its micro-batches' forward and backward), the wait on
    the gradient buckets (sync) and the rest (data, optimizer step, bookkeeping). Host clock only."""

    def __init__(self) -> None:
        self.began = self._mark = self._micro = self._sync_start = 0.0
        self.compute = self.sync = self.rest = 0.0  # of the last step timed

    def step_begins(self) -> None:
        """Before the step's data is fetched."""
        self.began = time.perf_counter()

    def attempt_begins(self) -> None:
        """Before each attempt at the step's micro-batches: an OOM retry times its own."""
        self._mark = self._micro = 0.0

    def micro_batch_begins(self) -> None:
        now = time.perf_counter()
        if self._mark:
            self._micro += now - self._mark
        self._mark = now

    def sync_begins(self) -> float:
        """The compute seconds of this attempt; `sync` and `rest` still hold the previous step's."""
        self._sync_start = now = time.perf_counter()
        self.compute = self._micro + (now - self._mark if self._mark else 0.0)
        return self.compute

    def sync_done(self) -> None:
        self.sync = time.perf_counter() - self._sync_start

    def step_done(self) -> None:
        if self.began:
            self.rest = max(time.perf_counter() - self.began - self.compute - self.sync, 0.0)


SHRINK_MARGIN = 2.0  # under the norm test, shrink only to a batch that is at least this x the floor


@dataclass(frozen=True)
class Limits:
    ranks: int
    base: int  # B0
    max_batch: int  # B_max
    cap: int  # largest micro-batch that fits
    min_k: int  # 2 with one rank (the noise scale needs two micro-batches per step)
    hysteresis: float
    max_growth: float
    theta: float  # norm test; 0 = off


def candidates(lim: Limits, sizes: list[int]) -> list[tuple[int, int]]:
    """(m, k) with m in `sizes` (≤ cap), k ≥ min_k, B0 ≤ n·m·k ≤ B_max."""
    out = []
    for m in sorted({s for s in sizes if 1 <= s <= lim.cap}):
        for k in range(lim.min_k, lim.max_batch // (lim.ranks * m) + 1):
            if lim.ranks * m * k >= lim.base:
                out.append((m, k))
    return out


def decide(lim: Limits, model: StepTimeModel, phi: float, current: tuple[int, int],
           sizes: list[int]) -> tuple[int, int]:
    """The (m, k) to use next: best goodput within the growth window and above the norm-test floor;
    the current one unless the gain beats the hysteresis (or the current batch is under the floor)."""
    if math.isnan(phi):
        return current
    b_now = lim.ranks * current[0] * current[1]

    def batch(c: tuple[int, int]) -> int:
        return lim.ranks * c[0] * c[1]

    def goodput(c: tuple[int, int]) -> float:
        return batch(c) / model.step_time(*c) * efficiency(phi, batch(c), lim.base)

    window = [c for c in candidates(lim, sizes)
              if b_now / lim.max_growth <= batch(c) <= b_now * lim.max_growth]
    if not window:
        return current
    floor = phi / lim.theta**2 if lim.theta > 0 else 0.0
    floor = min(floor, max(batch(c) for c in window))  # the norm test can ask for more than allowed
    # A smaller batch must meet the floor SHRINK_MARGIN times over: φ moves ±30% between decisions,
    # and a floor met by a hair let the batch alternate 32 <-> 64 four times in 300 steps (pylm).
    allowed = [c for c in window if batch(c) >= floor and (batch(c) >= b_now or batch(c) >= SHRINK_MARGIN * floor)]
    # Candidates within rounding of the best are equal: take the largest micro-batch among them
    # (fewer, larger kernels), not whichever the last bit favoured.
    top = max(goodput(c) for c in allowed)
    best = max((c for c in allowed if goodput(c) >= top * (1 - 1e-9)), key=lambda c: (c[0], -c[1]))
    # Shapes of that batch within the hysteresis of it are equal too: step times move ±10% on a
    # shared host, and on a CI host one run split B = 32 as (4, 4) and a twin run as (2, 8). Keep
    # the running micro-batch if it is among them, else take the largest.
    near = [c for c in allowed if batch(c) == batch(best) and goodput(c) * (1 + lim.hysteresis) >= goodput(best)]
    near = near or [best]  # a NaN goodput compares False even with itself
    best = next((c for c in near if c[0] == current[0]), max(near, key=lambda c: c[0]))
    if best == current:
        return current
    if b_now < floor or goodput(best) >= (1 + lim.hysteresis) * goodput(current):
        return best
    return current


def start_shape(ranks: int, batch_size: int, accumulation: int, max_batch: int,
                samples: int) -> tuple[int, int, int, int, int]:
    """(B0, B_max, min k, m, k) at the start, or a ConfigError naming the setting at fault
    (batch_size and accumulation are >= 1 already: TrainConfig checks them on construction)."""
    base, per_rank = ranks * batch_size * accumulation, batch_size * accumulation
    top = min(max_batch or 16 * base, samples)
    if top < base:
        raise ConfigError(f"adaptive.max_batch={max_batch} is below the starting global batch {base} "
                          f"({ranks} ranks x {batch_size} x {accumulation}); raise it or set 0")
    min_k = 2 if ranks == 1 else 1
    if per_rank < min_k:
        raise ConfigError("adaptive batch sizing on one rank needs train.batch_size x train.accumulation >= 2 "
                          "(the noise scale compares two micro-batches per step)")
    m = batch_size if accumulation >= min_k else largest_divisor(per_rank, per_rank / 2)
    return base, top, min_k, m, per_rank // m


def reshape(batch: int, ranks: int, at_most: float, min_k: int, max_batch: int) -> tuple[int, int]:
    """(m, k) for `ranks` ranks with the global batch nearest `batch` within B_max: the fewest
    micro-batches of at most `at_most` (and at least `min_k` of them). Used for a new elastic world,
    a checkpoint from another world size, and Smith et al.'s decayed batch."""
    per_rank = max(min_k, min(round(batch / ranks), max_batch // ranks))
    m = largest_divisor(per_rank, min(at_most, per_rank / min_k))
    return m, per_rank // m


def decayed_batch(lim: Limits, gamma: float, decays: int) -> tuple[int, int]:
    """Smith et al.'s rule (adaptive.policy=decay_to_batch): after `decays` lr decays by `gamma`, the
    global batch B0 / gamma^decays, capped at B_max (the lr keeps what the cap leaves of the decay);
    (m, k) with the fewest micro-batches that fit the cap."""
    return reshape(round(lim.base / gamma**decays), lim.ranks, lim.cap, lim.min_k, lim.max_batch)
