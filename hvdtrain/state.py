"""The one list of resumable state, and the session a run's loop reports to.

Every part of training that must survive a restart is registered once, by name, in a `Registry`:
checkpoints save and restore it (hvdtrain/checkpoint.py writes whatever the registry hands it and
knows no part types), and an elastic run commits, restores and broadcasts the same list
(hvdtrain/elastic.py). Parts are of two kinds:
- shared: the same on every rank (model, optimizer, sampler, precision, batch policy); rank 0's
  copy is saved and every rank loads it;
- per-rank: different on every rank (gradient-codec residuals, ZeRO shards, random-number state);
  every rank's copy is saved, and each part decides how to load from all of them (its own at the
  same world size; a ZeRO shard re-shards from every rank's).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import torch

from hvdtrain.common import rng_state, set_rng_state
from hvdtrain.errors import CheckpointError
from hvdtrain.world import World


class Resumable(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


class PerRank(Protocol):
    def state_dict(self) -> Any: ...

    def load_rank_states(self, states: list[Any]) -> None:
        """Every saved rank's state, in rank order (None where a rank saved none)."""


class Registry:
    """Named resumable parts. A part added under a name whose state is being carried (an elastic
    run's next world) loads that state as it is added."""

    def __init__(self) -> None:
        self._shared: dict[str, Resumable] = {}
        self._per_rank: dict[str, PerRank] = {}
        self._optional: set[str] = set()  # may be absent from a saved state (added after format 1)
        self._carried: dict[str, Any] = {}

    def add(self, name: str, part: Resumable, optional: bool = False) -> None:
        self._shared[name] = part
        if optional:
            self._optional.add(name)
        if name in self._carried:
            part.load_state_dict(self._carried.pop(name))

    def add_per_rank(self, name: str, part: PerRank) -> None:
        self._per_rank[name] = part

    def add_all(self, parts: Mapping[str, Resumable]) -> None:
        for name, part in parts.items():
            self.add(name, part)

    def names(self) -> set[str]:
        return set(self._shared) | set(self._per_rank)

    def remove(self, names: Iterable[str]) -> None:
        for name in names:
            self._shared.pop(name, None)
            self._per_rank.pop(name, None)

    def carry(self, states: Mapping[str, Any]) -> None:
        """Hold `states` for parts not registered now: each is loaded when its part is added."""
        self._carried.update(states)

    def state_dict(self) -> dict[str, Any]:
        """Every shared part's state (and the states carried for parts not added yet)."""
        return {**self._carried, **{name: part.state_dict() for name, part in self._shared.items()}}

    def rank_state_dict(self) -> dict[str, Any]:
        """This rank's per-rank parts."""
        return {name: part.state_dict() for name, part in self._per_rank.items()}

    def load_state_dict(self, state: Mapping[str, Any], source: str, carry_rest: bool = False,
                        skip: Iterable[str] = ()) -> None:
        """Load every shared part but those in `skip` from `state` (`source` names it in errors); with
        `carry_rest`, states of names not registered now are carried for parts added later."""
        for name, part in self._shared.items():
            if name in skip:
                continue
            if name not in state:
                if name in self._optional:
                    continue
                raise CheckpointError(f"{source} has no {name!r} state (it was saved by a run without it)")
            try:
                part.load_state_dict(state[name])
            except CheckpointError as exc:
                raise CheckpointError(f"{source}: {exc}") from None
        if carry_rest:
            self.carry({k: v for k, v in state.items() if k not in self._shared})

    def load_rank_states(self, ranks: list[Mapping[str, Any]]) -> None:
        """Load every per-rank part from all saved ranks' entries (in rank order)."""
        for name, part in self._per_rank.items():
            part.load_rank_states([r.get(name) for r in ranks])


class OptimizerState:
    """A torch optimizer as a shared part; it refuses a ZeRO-sharded state, which only a sharded
    optimizer (memory.zero_stage 1 or 2) can load."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer

    def state_dict(self) -> Any:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: Any) -> None:
        if "zero_param_groups" in state and isinstance(self.optimizer, torch.optim.Optimizer):
            raise CheckpointError("it holds ZeRO-sharded optimizer state; resume it with memory.zero_stage=1, 2 or 3 "
                                  "(it re-shards to any world size)")
        self.optimizer.load_state_dict(state)


class RngState:
    """This process's random-number state, per rank: restored only into a world of the same size
    (elsewhere each rank keeps its fresh seed-derived state)."""

    def __init__(self, world: World) -> None:
        self.world = world

    def state_dict(self) -> dict[str, Any]:
        return rng_state()

    def load_rank_states(self, states: list[Any]) -> None:
        if len(states) == self.world.size and states[self.world.rank] is not None:
            set_rng_state(states[self.world.rank])


class Session:
    """How one call of the loop, in one world, starts, reports its steps and ends. This one is a
    plain run: it restores (or broadcasts) and nothing else. An elastic run's session
    (hvdtrain/elastic.py) commits every few steps and may end the world to re-form it."""

    def __init__(self, registry: Registry | None = None) -> None:
        self.registry = registry or Registry()

    def begin(self, restore: Callable[[], tuple[int, str | None]]) -> tuple[int, str | None]:
        """(step, checkpoint path or None) to start from. All ranks call."""
        return restore()

    def step_done(self, step: int, last: bool) -> None:
        """After every optimizer step, on all ranks."""

    def end(self) -> None:
        """When the loop leaves this world, on every path (also on an exception)."""
