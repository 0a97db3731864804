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
from pathlib import Path
from typing import Any, Protocol

import torch
from horovod.common.elastic import State
from torch import nn
from torch.utils.data import Dataset

from hvdtrain.config import Config
from hvdtrain.data import ShardedBatchSampler
from hvdtrain.errors import ConfigError
from hvdtrain.optim import build_optimizer
from hvdtrain.tasks import LossFn, classification_loss
from hvdtrain.world import World, _import_horovod


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class ElasticState(State):
    """What a commit saves and a reset restores and broadcasts: model, optimizer, sampler, the step,
    and `extra` objects with state_dict()/load_state_dict() (e.g. a batch-size controller)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, sampler: ShardedBatchSampler,
                 extra: dict[str, Stateful] | None = None) -> None:
        hvd = _import_horovod()
        # The host-update check broadcasts a tuple from rank 0; named like every other collective.
        super().__init__(bcast_object=lambda obj: hvd.broadcast_object(obj, root_rank=0, name="hvdtrain.elastic.hosts"),
                         get_rank=hvd.rank)
        self.model, self.optimizer, self.sampler = model, optimizer, sampler
        self.extra = dict(extra or {})
        self.step = 0
        self.started = False  # False until the first world has restored or broadcast the start state
        self.resets = 0
        self._saved: dict[str, Any] = {}
        self.save()

    def _small(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "sampler": self.sampler.state_dict(), "step": self.step,
                "started": self.started, "resets": self.resets,
                "extra": {k: v.state_dict() for k, v in self.extra.items()}}

    def _load_small(self, small: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(small["optimizer"])
        self.sampler.load_state_dict(small["sampler"])
        self.step, self.started, self.resets = small["step"], small["started"], small["resets"]
        for key, value in small["extra"].items():
            self.extra[key].load_state_dict(value)
        # A failed step may have left partial gradients; the next backward must start from zero.
        self.optimizer.zero_grad(set_to_none=True)

    def save(self) -> None:
        self._saved = copy.deepcopy({"model": self.model.state_dict(), **self._small()})

    def restore(self) -> None:
        # Copies again: optimizer.load_state_dict keeps the given tensors, which later steps update in place.
        saved = copy.deepcopy(self._saved)
        self.model.load_state_dict(saved.pop("model"))
        self._load_small(saved)

    def sync(self) -> None:
        """The most advanced rank's state on every rank (new workers included). All ranks must call."""
        hvd = _import_horovod()
        # Horovod keeps surviving hosts first, so this is rank 0; but a new worker that got rank 0
        # must not overwrite everyone with its fresh state (Horovod's own sync assumes it never does).
        marks = hvd.allgather_object((self.started, self.step), name="hvdtrain.elastic.marks")
        root = max(range(len(marks)), key=lambda r: (marks[r], -r))
        # Tensors in place by name; the rest pickled. Not broadcast_optimizer_state: on a new worker's
        # empty optimizer it would run a zero-gradient step (weight decay, Adam's counter; horovod#2805).
        hvd.broadcast_parameters(self.model.state_dict(), root_rank=root)
        self._load_small(hvd.broadcast_object(self._small(), root_rank=root, name="hvdtrain.elastic.sync"))
        self.save()

    def reset(self) -> None:
        self.resets += 1


class AdaptiveCarry:
    """Carries the batch-size controller's state from one world to the next: each world builds its
    own controller (its world, reducer and probe are that world's), which `attach` hands this state."""

    def __init__(self) -> None:
        self.ctl: Any = None  # this world's controller, once attached
        self.state: dict[str, Any] | None = None  # committed or synced, for the next world's controller

    def state_dict(self) -> dict[str, Any] | None:
        return self.ctl.state_dict() if self.ctl is not None else self.state

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        # Restores and syncs happen between worlds: the attached controller is the old world's, and
        # its norm hooks would otherwise stay on the parameters.
        if self.ctl is not None:
            self.ctl.meter.remove()
        self.ctl, self.state = None, state

    def attach(self, ctl: Any) -> None:
        if self.state is not None:
            ctl.load_state_dict(self.state, new_world=True)
        self.ctl, self.state = ctl, None


class Session:
    """The hooks `_fit` calls in one world of an elastic run."""

    def __init__(self, state: ElasticState, world: World, cfg: Config) -> None:
        self.state, self.world, self.every = state, world, cfg.elastic.commit_every
        self.sampler = state.sampler
        self.adaptive: AdaptiveCarry | None = state.extra.get("adaptive")  # type: ignore[assignment]
        self.trace = Path(cfg.log.dir) / "samples.jsonl" if cfg.elastic.trace_samples and cfg.log.dir else None
        state.sampler.take_drawn()  # micro-batches of a step that failed before the reset

    def begin(self, restore: Any) -> tuple[int, str | None]:
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

    def _write_trace(self, step: int) -> None:
        drawn = [i for micro in self.sampler.take_drawn() for i in micro]
        ranks = self.world.allgather_object(drawn, name="hvdtrain.elastic.trace")
        if self.world.is_root:
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
                cfg: Config, eval_set: Dataset | None = None, loss_fn: LossFn = classification_loss,
                extra: dict[str, Stateful] | None = None) -> Any:
    """`fit` that survives workers leaving and joining. All ranks must call; `extra` objects are
    committed, restored and broadcast with the model."""
    from hvdtrain.loop import fit_once

    check_launcher(world)
    tc = cfg.train
    model.to(world.device)
    optimizer = optimizer or build_optimizer(model, cfg.optim)
    sampler = ShardedBatchSampler(len(train_set), world, tc.batch_size, tc.accumulation, cfg.seed, tc.shuffle,
                                  keep_global_batch=True)
    sampler.trace = cfg.elastic.trace_samples
    if cfg.adaptive.enabled:
        extra = {**(extra or {}), "adaptive": AdaptiveCarry()}
    state = ElasticState(model, optimizer, sampler, extra)

    def train(state: ElasticState) -> Any:
        # A fresh World each time: after a reset, rank and size are those of the new world.
        now = World.init()
        state.sampler.resize(now)
        return fit_once(now, model, optimizer, train_set, cfg, eval_set, loss_fn, elastic=Session(state, now, cfg))

    return _import_horovod().elastic.run(train)(state)
