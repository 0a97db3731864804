"""Rank 0's batch decision on its way to every rank, without a blocking collective.

A decision step starts one broadcast of [m, k, φ] from rank 0; the step after it waits on it and
applies it, so the broadcast runs behind that step's forward and backward. Blocking, it cost ~2.7
ms a decision (pylm, 2 ranks, Gloo; Horovod's negotiation cycle plus the ranks' skew), 1% of every
step at one decision in 10 steps. Ranks' statistics can differ in the last bits, so rank 0's choice
and noise scale hold for all (Adam's state, rescaled with φ, must stay bitwise equal across ranks).
"""

from __future__ import annotations

from typing import Any

import torch

from hvdtrain.world import World


class PendingDecision:
    """At most one decision in flight. Every method is called by all ranks at the same step."""

    NAME = "hvdtrain.adaptive.decision"

    def __init__(self, world: World) -> None:
        self.world = world
        self.step = 0  # the step that decided
        self._handle: Any = None
        self._values: list[float] | None = None
        self._error = ""  # rank 0's failure, as text (other ranks only learn that it failed)
        self._cause: Exception | None = None

    @property
    def waiting(self) -> bool:
        return self._handle is not None or self._values is not None

    def start(self, step: int, decision: tuple[int, int, float] | None, cause: Exception | None = None) -> None:
        """Rank 0 passes its (m, k, φ), or None with the exception that stopped it (others: None)."""
        mine = torch.zeros(3, dtype=torch.float64)
        if self.world.is_root:
            mine[:] = torch.tensor(decision if decision is not None else (-1.0, 0.0, 0.0), dtype=torch.float64)
        self.step, self._values = step, None
        self._cause, self._error = cause, repr(cause) if cause is not None else ""
        self._handle = self.world.broadcast_async(mine, name=self.NAME)

    def values(self) -> list[float] | None:
        """[m, k, φ] as broadcast (waiting for them if still in flight); None with nothing pending."""
        if self._handle is not None:
            self._values, self._handle = self.world.wait(self._handle).tolist(), None
        return self._values

    def take(self) -> tuple[int, int, float]:
        """The decision, now applied (cleared here); a RuntimeError on every rank if rank 0's failed."""
        values = self.values()
        assert values is not None, "no decision pending"
        self._values = None
        if values[0] < 0:
            why = self._error or "see rank 0's output"
            raise RuntimeError(f"step {self.step}: rank 0's batch decision failed ({why}); every rank stops here") \
                from self._cause
        return int(values[0]), int(values[1]), values[2]

    def drop(self) -> None:
        """Forget it (a new world reshapes the batch instead). Waits if still in flight."""
        self.values()
        self._values = None

    def state_dict(self) -> list[Any] | None:
        values = self.values()
        return None if values is None else [self.step, values, self._error]

    def load_state_dict(self, state: list[Any] | None) -> None:
        """None (nothing pending, or a checkpoint from before 6 December) or [step, values, error]."""
        self._handle, self._cause = None, None
        self._values = None if state is None else [float(v) for v in state[1]]
        self.step, self._error = (0, "") if state is None else (int(state[0]), str(state[2]))
