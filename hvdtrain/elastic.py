"""Elastic training on Horovod: workers may leave (fail, or be removed by the host discovery script)
and join while training goes on. Run under
`horovodrun --gloo -np N --min-np A --max-np B --host-discovery-script S hvdtrain train --elastic`.

How a change of world plays out (Horovod's `hvd.elastic.run` drives it):
- Every `elastic.commit_every` steps all ranks copy the training state to host memory (`commit`),
  then agree (one broadcast) whether the driver announced new or removed hosts; if so they all
  leave the loop together (HostsUpdatedInterrupt), re-form the world and continue from the commit.
- A worker that dies makes the survivors' next collective fail (HorovodInternalError): they roll
  back to the last commit, re-form the world without it and replay the steps since that commit.
- After each re-forming, rank 0's committed state is broadcast to everyone (new workers included),
  then a new `World` and gradient reducer are made for the new size (bucket names and codecs depend
  on it) and the loop resumes at the committed step.

What a commit holds is the run's registry of resumable state (hvdtrain/state.py), the same list a
checkpoint saves, without its per-rank parts (codec residuals, random-number state: a rank's share
of the data changes with the world). Parts made anew in each world (the precision's loss scale, the
batch policy) take their committed state when the next world adds them.

Batch policy: the global batch B of the first world is kept for the whole run (with adaptive batch
sizing, B is the controller's: it is kept where the new size divides it, else the nearest B that
one does, and the lr follows B; the memory probe runs again in the new world). Each step still
trains on the same slice of the epoch's permutation, dealt over however many ranks there are (in
micro-batches of at most train.batch_size, uneven shares weighted exactly), so the learning rate,
its schedule, the number of steps and the samples of every step are those of an undisturbed run.
The alternative, keeping the per-rank batch and rescaling the LR for the new size, changes the
optimisation itself at every membership change; keeping B changes only speed.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from hvdtrain.common import num_samples
from hvdtrain.config import Config
from hvdtrain.data import ShardedBatchSampler
from hvdtrain.errors import ConfigError
from hvdtrain.optim import build_optimizer
from hvdtrain.state import OptimizerState, Registry, Resumable, Session
from hvdtrain.step import LossFn
from hvdtrain.world import World, elastic_state_base, live_rank, run_elastic

# fit_once's signature (hvdtrain/loop.py), passed in so that this module never imports the loop.
RunOnce = Callable[..., Any]


class ElasticState(elastic_state_base()):  # type: ignore[misc]
    """What a commit saves and a reset restores and broadcasts: the registry's shared parts, the
    step, and whether the first world has started (restored or broadcast its start state)."""

    def __init__(self, world: World, model: nn.Module, registry: Registry) -> None:
        self.world, self.model, self.registry = world, model, registry
        self.persistent = registry.names()  # parts made once for the whole run; the rest are each world's
        # The host-update check broadcasts a tuple from rank 0; named like every other collective.
        super().__init__(bcast_object=lambda obj: self.world.broadcast_object(obj, name="hvdtrain.elastic.hosts"),
                         get_rank=live_rank)
        self.step = 0
        self.started = False  # False until the first world has restored or broadcast the start state
        self.resets = 0
        self._saved: dict[str, Any] = {}
        self.save()

    def _small(self) -> dict[str, Any]:
        parts = {k: v for k, v in self.registry.state_dict().items() if k != "model"}
        return {"parts": parts, "step": self.step, "started": self.started, "resets": self.resets}

    def _load_small(self, small: dict[str, Any]) -> None:
        # Parts of the world that ended are not registered now: their states wait for the next world's.
        self.registry.load_state_dict(small["parts"], "the elastic commit", carry_rest=True, skip={"model"})
        self.step, self.started, self.resets = small["step"], small["started"], small["resets"]
        # A failed step may have left partial gradients; the next backward must start from zero.
        for p in self.model.parameters():
            p.grad = None

    def save(self) -> None:
        self._saved = copy.deepcopy({"model": self.model.state_dict(), **self._small()})

    def restore(self) -> None:
        # Copies again: optimizer.load_state_dict keeps the given tensors, which later steps update in place.
        saved = copy.deepcopy(self._saved)
        self.model.load_state_dict(saved.pop("model"))
        self._load_small(saved)

    def carry_world_parts(self, names: set[str]) -> None:
        """The world ended: its own parts (`names`) leave the registry, and the next world's take
        their committed state (after a failure the steps since the commit are replayed; a host
        change is announced right after a commit, so the two agree)."""
        self.registry.remove(names)
        self.registry.carry({k: v for k, v in copy.deepcopy(self._saved["parts"]).items() if k in names})

    def sync(self) -> None:
        """The most advanced rank's state on every rank (new workers included). All ranks must call."""
        # Horovod keeps surviving hosts first, so this is rank 0; but a new worker that got rank 0
        # must not overwrite everyone with its fresh state (Horovod's own sync assumes it never does).
        marks = self.world.allgather_object((self.started, self.step), name="hvdtrain.elastic.marks")
        root = max(range(len(marks)), key=lambda r: (marks[r], -r))
        # Tensors in place by name; the rest pickled. Not broadcast_optimizer_state: on a new worker's
        # empty optimizer it would run a zero-gradient step (weight decay, Adam's counter; horovod#2805).
        self.world.broadcast_parameters(self.model.state_dict(), root=root)
        self._load_small(self.world.broadcast_object(self._small(), name="hvdtrain.elastic.sync", root=root))
        self.save()

    def reset(self) -> None:
        self.resets += 1


class ElasticSession(Session):
    """One world of an elastic run: the loop's session, committing every `elastic.commit_every` steps."""

    def __init__(self, state: ElasticState, world: World, sampler: ShardedBatchSampler, cfg: Config) -> None:
        super().__init__(state.registry)
        self.state, self.world, self.sampler, self.every = state, world, sampler, cfg.elastic.commit_every
        self.trace = Path(cfg.log.dir) / "samples.jsonl" if cfg.elastic.trace_samples and cfg.log.dir else None
        sampler.take_drawn()  # micro-batches of a step that failed before the reset

    def begin(self, restore: Callable[[], tuple[int, str | None]]) -> tuple[int, str | None]:
        """First world: restore a checkpoint (or broadcast rank 0's weights) and commit that. Later
        worlds: continue from the commit that `hvd.elastic.run` just synced. `started` comes from
        rank 0, so all ranks take the same branch."""
        if self.state.started:
            return self.state.step, None
        step, resumed = restore()
        self.state.step, self.state.started = step, True
        self.state.save()
        return step, resumed

    def step_done(self, step: int, last: bool) -> None:
        """After every optimizer step, on all ranks: trace the samples, commit when due. May raise
        HostsUpdatedInterrupt (on every rank at once) to re-form the world."""
        if self.trace is not None:
            self._write_trace(step)
        self.state.step = step
        if step % self.every == 0 and not last:
            self.state.commit()

    def end(self) -> None:
        self.state.carry_world_parts(self.registry.names() - self.state.persistent)

    def _write_trace(self, step: int) -> None:
        drawn = [i for micro in self.sampler.take_drawn() for i in micro]
        ranks = self.world.allgather_object(drawn, name="hvdtrain.elastic.trace")
        if self.world.is_root and self.trace is not None:
            self.trace.parent.mkdir(parents=True, exist_ok=True)
            line = {"step": step, "world_size": self.world.size, "resets": self.state.resets, "ranks": ranks}
            with open(self.trace, "a") as f:
                f.write(json.dumps(line) + "\n")


def check_launcher(world: World) -> None:
    """Elastic runs of more than one rank need horovodrun's elastic mode (Gloo)."""
    if world.size > 1 and os.environ.get("HOROVOD_ELASTIC") != "1":
        raise ConfigError("elastic.enabled=true needs horovodrun's elastic mode: launch with --gloo --min-np A "
                          "--max-np B --host-discovery-script S (or hvdtrain launch --elastic ...)")


def fit_elastic(world: World, model: nn.Module, optimizer: torch.optim.Optimizer | None, train_set: Dataset,
                cfg: Config, eval_set: Dataset | None, loss_fn: LossFn, run_once: RunOnce,
                extra: dict[str, Resumable] | None = None) -> Any:
    """`fit` that survives workers leaving and joining: `run_once` (the loop's fit_once) runs in each
    world. All ranks must call; `extra` objects are committed, restored and broadcast with the model."""
    check_launcher(world)
    tc = cfg.train
    model.to(world.device)
    optimizer = optimizer or build_optimizer(model, cfg.optim)
    sampler = ShardedBatchSampler(num_samples(train_set), world, tc.batch_size, tc.accumulation, cfg.seed, tc.shuffle,
                                  keep_global_batch=True, variable=cfg.adaptive.enabled,
                                  trace=cfg.elastic.trace_samples)
    registry = Registry()
    registry.add_all({"model": model, "optimizer": OptimizerState(optimizer), "sampler": sampler, **(extra or {})})
    state = ElasticState(world, model, registry)

    def train(state: ElasticState) -> Any:
        # A fresh World each time: after a reset, rank and size are those of the new world.
        now = state.world = World.init()
        sampler.resize(now)
        return run_once(now, model, optimizer, train_set, cfg, eval_set, loss_fn, sampler,
                        ElasticSession(state, now, sampler, cfg))

    return run_elastic(train, state)
