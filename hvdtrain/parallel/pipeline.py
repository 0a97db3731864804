"""Pipeline model parallelism: this rank runs one stage of the model's layers for one replica.

The N = S x D ranks form S stages x D replicas (layout.py). Per optimizer step, every stage runs
its schedule (schedule.py) over the step's m micro-batches: a forward receives micro-batch j's
activation from the stage before (MPI, p2p.py), runs the stage and sends the result on; a backward
receives the gradient of that result from the stage after and sends its input's gradient back.
Every stage loads the same batches (the first needs the inputs, the last the labels, all the sizes).

Collective order per step, the same on every rank: the stage's gradient buckets, averaged among
its D replicas only (a Horovod process set, through the usual reducer); then, with tied parameters
(the first and last stage both hold one, e.g. GPT's embedding and head), their gradients summed
over the two stages' ranks; then one allreduce over all N ranks of the stop flag, whether any stage
saw a non-finite gradient, and the squared gradient norm for clipping. Whether to step, skip or
stop is read from that last sum, so every rank of every stage decides alike.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from hvdtrain.activations import checkpoint_blocks
from hvdtrain.comm.mpi import mpi_comm
from hvdtrain.comm.reducer import HookedBuckets
from hvdtrain.common import batch_len, to_device
from hvdtrain.config import Config
from hvdtrain.data import eval_loader
from hvdtrain.errors import CheckpointError, ConfigError
from hvdtrain.metrics import MetricSums
from hvdtrain.parallel.layout import Layout
from hvdtrain.parallel.p2p import Link
from hvdtrain.parallel.partition import Stage, boundaries, layer_times, pipeline_layers, shared_parameters
from hvdtrain.parallel.schedule import actions
from hvdtrain.precision import Precision
from hvdtrain.step import NO_HOOKS, LossFn, Outcome, StepFlags, StepHooks, checked
from hvdtrain.world import World

ACT, GRAD = 0, 1
_ZERO = torch.zeros(())  # what a stage without the loss adds to the metric sums (names only)


class _Captured(Exception):
    """Carries the first stage's output out of `loss_fn` (only the last stage computes a loss)."""

    def __init__(self, output: torch.Tensor) -> None:
        super().__init__("first pipeline stage output")
        self.output = output


class _Front(nn.Module):
    """What `loss_fn` calls as the model on the first stage: runs the stage on the inputs the
    loss_fn hands it, then leaves the loss_fn (its loss is the last stage's business)."""

    def __init__(self, stage: nn.Module) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, x: Any) -> Any:
        raise _Captured(self.stage(x))


class _Fed(nn.Module):
    """What `loss_fn` calls as the model on the last stage: the stage run on the received activation
    (the loss_fn's own inputs went through the earlier stages)."""

    def __init__(self, stage: nn.Module, activation: torch.Tensor) -> None:
        super().__init__()
        self.stage, self.activation = stage, activation

    def forward(self, x: Any) -> Any:
        return self.stage(self.activation)


class StageState:
    """The registry's per-rank part for one stage's model and optimizer: replica 0 of each stage
    saves them, every replica of the stage loads them back. Resume needs the same stages."""

    def __init__(self, layout: Layout, rank: int, model: Any, optimizer: Any) -> None:
        self.layout, self.rank, self.model, self.optimizer = layout, rank, model, optimizer

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"stage": self.layout.stage(self.rank), "stages": self.layout.stages}
        if self.layout.replica(self.rank) == 0:
            out.update(model=self.model.state_dict(), optimizer=self.optimizer.state_dict())
        return out

    def load_rank_states(self, states: list[Any]) -> None:
        stage = self.layout.stage(self.rank)
        saved = [s for s in states if isinstance(s, dict) and "model" in s and s.get("stage") == stage]
        if not saved or saved[0].get("stages") != self.layout.stages:
            raise CheckpointError(f"the checkpoint holds no state for pipeline stage {stage} of {self.layout.stages}; "
                              "resume with the parallel.pipeline_stages it was saved with")
        self.model.load_state_dict(saved[0]["model"])
        self.optimizer.load_state_dict(saved[0]["optimizer"])


class Pipeline:
    """This rank's stage, its link to the neighbouring stages, and the step and evaluation that
    run the schedule. Made by `build` on every rank together."""

    def __init__(self, world: World, layout: Layout, stage: Stage, data: World, ends: World | None,
                 tied: list[nn.Parameter], link: Link, schedule: str) -> None:
        self.world, self.layout, self.stage, self.data, self.ends = world, layout, stage, data, ends
        self.tied, self.link, self.schedule = tied, link, schedule
        self.index = layout.stage(world.rank)
        replica = layout.replica(world.rank)
        self.first, self.last = self.index == 0, self.index == layout.stages - 1
        self.prev = layout.rank(self.index - 1, replica) if not self.first else -1
        self.next = layout.rank(self.index + 1, replica) if not self.last else -1
        self._keys: tuple[str, ...] | None = None  # the metric names, learned from the last stage once
        self.busy_s = 0.0

    @classmethod
    def build(cls, world: World, model: nn.Module, cfg: Config, cleanup: contextlib.ExitStack,
              sample: Callable[[], tuple[Any, LossFn]] | None = None) -> Pipeline:
        """Cut `model` (the same on every rank) and keep this rank's stage; the other stages'
        parameters are freed here, so `model` afterwards holds only this rank's layers. All ranks
        must call together; `cleanup` removes the process sets and the MPI communicator.
        `sample()`: one micro-batch and the loss_fn, for parallel.balance=time."""
        pc = cfg.parallel
        if world.controller != "mpi":
            raise ConfigError(f"parallel.pipeline_stages={pc.pipeline_stages} needs Horovod's MPI controller "
                              "(horovodrun --mpi, hvdtrain launch): activations move between stages as MPI "
                              "point-to-point messages, which Gloo does not offer")
        layout = Layout.of(pc.pipeline_stages, world.size)
        if cfg.memory.activation_checkpointing:
            checkpoint_blocks(model)  # before the cut: a stage has no `blocks` of its own
        layers = pipeline_layers(model)
        times = _agreed_times(world, layers, sample) if pc.balance == "time" else None
        bounds = boundaries(layers, layout.stages, pc.balance, times)
        index = layout.stage(world.rank)
        shared = shared_parameters(layers, bounds)
        odd = [stages for stages in shared.values() if stages != {0, layout.stages - 1}]
        if odd:
            raise ConfigError(f"a parameter is shared by pipeline stages {sorted(odd[0])}; only the first and the last "
                              "stage may share one (tied embeddings): change parallel.balance")
        stage = Stage(layers[bounds[index]:bounds[index + 1]], bounds[index])
        _free_others(model, stage)
        groups = [world.group(layout.stage_ranks(s)) for s in range(layout.stages)]
        for group in groups:
            cleanup.callback(group.leave)
        ends = world.group(layout.ends()) if shared else None
        if ends is not None and ends is not world:
            cleanup.callback(ends.leave)
        # In the whole model's order on both ends: their allreduces pair up by name.
        mine = {id(p) for p in stage.parameters()}
        order = {id(p): p for layer in layers for p in layer.parameters() if id(p) in shared and id(p) in mine}
        tied = list(order.values())
        comm = mpi_comm(world.rank)
        link = Link(comm, world.device)
        cleanup.callback(link.free)
        world.print(f"hvdtrain: pipeline: {layout.describe()}; layers per stage "
                    f"{[bounds[s + 1] - bounds[s] for s in range(layout.stages)]} (parallel.balance={pc.balance}), "
                    f"schedule {pc.schedule}" + (f", {len(shared)} tied parameter(s) first<->last" if shared else ""))
        return cls(world, layout, stage, groups[index], ends, tied, link, pc.schedule)

    # The step: the loop calls this where a data-parallel run calls hvdtrain.step.train_step.

    def train_step(self, model: nn.Module, optimizer: Any, reducer: HookedBuckets, micro_batches: list[Any],
                   loss_fn: LossFn, sums: MetricSums, clip: float, device: torch.device,
                   beat: Callable[[str, bool], None] | None = None, rank_samples: float | None = None,
                   precision: Precision | None = None, hooks: StepHooks = NO_HOOKS,
                   flags: StepFlags | None = None) -> Outcome:
        """One optimizer step of the schedule over `micro_batches` (this replica's); same contract as
        hvdtrain.step.train_step. All ranks must call."""
        precision = precision or Precision()
        beat = beat or (lambda phase, collective: None)
        if flags is None:
            raise ValueError("a pipeline step needs StepFlags: every stage must learn the step's verdict")
        batches = [to_device(b, device) for b in micro_batches]
        sizes = [batch_len(b) for b in batches]
        m = len(batches)
        saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        losses: list[tuple[torch.Tensor, dict[str, Any], int]] = []
        hooks.attempt_begins()
        for kind, j in actions(self.schedule, self.index, self.layout.stages, m):
            if kind == "F":
                beat(f"pipeline forward of micro-batch {j} (waits for stage {self.index - 1})", True)
                hooks.micro_batch_begins(j)
                divisor = rank_samples / sizes[j] if rank_samples else m
                saved[j] = self._forward(batches[j], sizes[j], j, loss_fn, precision, divisor, losses)
            else:
                beat(f"pipeline backward of micro-batch {j} (waits for stage {self.index + 1})", True)
                reducer.arm(last_micro_batch=j == m - 1, left=m - 1 - j)
                self._backward(saved.pop(j), sizes[j], j, precision)
        self.link.drain()
        beat("gradient allreduce among the stage's replicas, then the step verdict", True)
        finite = reducer.synchronize()
        self._sum_tied()
        params = list(model.parameters())
        sq = _squared_norm(p for p in params if self.first or all(p is not t for t in self.tied)) if clip > 0 else 0.0
        self._learn_keys(losses)
        nonfinite, sq_total = flags.settle([0.0 if finite else 1.0, sq])
        outcome = hooks.after_sync(reducer, nonfinite < 0.5)
        for loss, batch_sums, n in losses:
            sums.add(loss, batch_sums, n)
        if not self.last:
            assert self._keys is not None
            sums.add(_ZERO, {k: _ZERO for k in self._keys if k != "loss"}, 0)
        stepped = outcome is Outcome.STEPPED
        if stepped and clip > 0:
            scale = precision.scaler.scale if precision.scaler is not None else 1.0
            norm = math.sqrt(sq_total / self.layout.replicas) / scale  # each stage counted once per replica
            coef = clip / (norm + 1e-6)
            if coef < 1.0:
                for p in params:
                    if p.grad is not None:
                        p.grad.mul_(coef)
        precision.step(optimizer, params if precision.scaler is not None else [], stepped, 0.0, reducer)
        reducer.zero_grad(optimizer)
        return outcome

    def _forward(self, batch: Any, n: int, j: int, loss_fn: LossFn, precision: Precision, divisor: float,
                 losses: list[tuple[torch.Tensor, dict[str, Any], int]]) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Micro-batch j through this stage: (its input activation or None, what backward starts from)."""
        x = None
        if not self.first:
            x = self.link.recv(self.prev, ACT, n, j, "train").requires_grad_()
        with precision.forward():
            if self.last:
                assert x is not None
                loss, batch_sums = checked(loss_fn(_Fed(self.stage, x), batch), training=True)
                losses.append((loss, batch_sums, n))
                return x, loss / divisor if divisor != 1 else loss
            out = self._front(batch, loss_fn) if self.first else self.stage(x)
        self.link.send(out, self.next, ACT, n, j, "train")
        return x, out

    def _front(self, batch: Any, loss_fn: LossFn) -> torch.Tensor:
        try:
            loss_fn(_Front(self.stage), batch)
        except _Captured as done:
            return done.output
        raise TypeError("loss_fn returned without calling the model: the first pipeline stage needs its inputs")

    def _backward(self, saved: tuple[torch.Tensor | None, torch.Tensor], n: int, j: int, precision: Precision) -> None:
        x, out = saved
        if self.last:
            precision.backward(out)
        else:
            grad = self.link.recv(self.next, GRAD, n, j, "train")
            torch.autograd.backward(out, grad)
        if x is not None:
            assert x.grad is not None
            self.link.send(x.grad, self.prev, GRAD, n, j, "train")

    def _sum_tied(self) -> None:
        """Tied parameters: each end's gradient (already averaged over its replicas) becomes their sum,
        the gradient of the whole model's one parameter. The first and last stages' ranks call."""
        if self.ends is None or not self.tied:
            return
        for i, p in enumerate(self.tied):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            total = self.ends.allreduce(p.grad, name=f"hvdtrain.pipe.tied.{i}", op="sum")
            # In place: the reducer's gradient buckets hold the grads as views and zero them there.
            p.grad.copy_(total.div_(self.layout.replicas))

    def _learn_keys(self, losses: list[tuple[torch.Tensor, dict[str, Any], int]]) -> None:
        """The metric names, from the last stage's first replica, once per run: the metrics allreduce
        needs the same names on every rank, and only the last stage computes them. All ranks call."""
        if self._keys is None:
            mine = ("loss", *losses[0][1]) if losses else None
            root = self.layout.rank(self.layout.stages - 1, 0)
            self._keys = tuple(self.world.broadcast_object(mine, name="hvdtrain.pipe.keys", root=root) or ("loss",))

    def evaluate(self, world: World, model: nn.Module, dataset: Dataset, loss_fn: LossFn, batch_size: int,
                 loader: dict[str, Any] | None = None) -> dict[str, float]:
        """Loss and metrics over `dataset`, sharded across the replicas and passed through the stages;
        the same contract as hvdtrain.loop.evaluate. All ranks must call."""
        model.eval()
        sums = MetricSums()
        with torch.no_grad():
            for j, batch in enumerate(eval_loader(dataset, self.data, batch_size, loader)):
                batch = to_device(batch, world.device)
                n = batch_len(batch)
                x = None if self.first else self.link.recv(self.prev, ACT, n, j, "eval")
                if self.last:
                    assert x is not None
                    loss, batch_sums = checked(loss_fn(_Fed(self.stage, x), batch))
                    sums.add(loss, batch_sums, n)
                else:
                    self.link.send(self._front(batch, loss_fn) if self.first else self.stage(x), self.next, ACT, n, j,
                                   "eval")
                if j % 8 == 7:
                    self.link.drain()  # bounds the activations queued for a slower next stage
        self.link.drain()
        model.train()
        root = self.layout.rank(self.layout.stages - 1, 0)
        keys = world.broadcast_object(tuple(sums.sums), name="hvdtrain.eval.keys", root=root)
        if not self.last:
            sums.add(_ZERO, {k: _ZERO for k in keys if k != "loss"}, 0)
        return sums.reduce(world, "hvdtrain.eval", keys)

    def stage_state(self, model_part: Any, optimizer_part: Any) -> StageState:
        return StageState(self.layout, self.world.rank, model_part, optimizer_part)


class _Input(nn.Module):
    """What `loss_fn` calls as the model to hand over its inputs (balance=time measures on them)."""

    def forward(self, x: Any) -> Any:
        raise _Captured(x)


def _agreed_times(world: World, layers: list[nn.Module], sample: Callable[[], tuple[Any, LossFn]] | None
                  ) -> list[float]:
    """Rank 0's forward+backward seconds per layer on one micro-batch, on every rank: timings differ
    between ranks, and every rank must cut the model the same way. All ranks call."""
    times: list[float] | str = []
    if world.is_root:
        try:
            if sample is None:
                raise ValueError("no sample micro-batch was given")
            batch, loss_fn = sample()
            times = "loss_fn returned without calling the model"
            loss_fn(_Input(), to_device(batch, world.device))
        except _Captured as given:
            times = layer_times([layer.to(world.device) for layer in layers], given.output)
        except Exception as exc:  # noqa: BLE001 - rank 0 alone failing must stop every rank, not hang them
            times = f"{type(exc).__name__}: {exc}"
    times = world.broadcast_object(times, name="hvdtrain.pipe.times")
    if isinstance(times, str):
        raise ConfigError(f"parallel.balance=time could not time the layers on rank 0 ({times}); use "
                          "parallel.balance=params or a list of layers per stage")
    return list(times)


def _squared_norm(params: Any) -> float:
    """Sum of squared gradient entries, with one host sync (clipping only)."""
    squares = [p.grad.detach().float().pow(2).sum() for p in params if p.grad is not None]
    return float(torch.stack(squares).sum()) if squares else 0.0


def _free_others(model: nn.Module, stage: nn.Module) -> None:
    """Drop the storage of every parameter and buffer outside `stage`: each rank keeps one stage."""
    keep = {id(t) for t in (*stage.parameters(), *stage.buffers())}
    with torch.no_grad():
        for t in (*model.parameters(), *model.buffers()):
            if id(t) not in keep:
                t.data = torch.empty(0, dtype=t.dtype, device=t.device)
