"""The training loop: plain code, top to bottom.

Collective order per optimizer step, identical on every rank: the gradient buckets the reducer
launches during the k-th micro-batch's backward (and whatever the batch policy's hooks start beside
them), then, on logging steps only, one metrics allreduce; at evaluation and checkpoint steps, their
named collectives. Which steps those are depends only on the step counter, the config and values
every rank holds alike, never on rank-local state, so ranks cannot diverge.

The loop talks to small interfaces: the batch policy (hvdtrain/policy.py: fixed, or adaptive), the
reducer (hvdtrain/comm/), the precision (hvdtrain/precision.py), the session (hvdtrain/state.py:
a plain run, or one world of an elastic run) and the registry of resumable state that checkpoints
and elastic commits share.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from hvdtrain.activations import checkpoint_blocks
from hvdtrain.checkpoint import Checkpointer
from hvdtrain.comm.build import make_reducer
from hvdtrain.comm.compression import AutoSelect, FixedCodec, codec_choice
from hvdtrain.comm.reducer import HookedBuckets
from hvdtrain.common import batch_len, num_samples, seed_everything, to_device
from hvdtrain.config import Config
from hvdtrain.data import ShardedBatchSampler, eval_loader, loader_options
from hvdtrain.errors import TrainingStopped
from hvdtrain.faults import FaultInjector
from hvdtrain.metrics import MetricSums, TrainLog
from hvdtrain.optim import LRSchedule, build_optimizer
from hvdtrain.policy import BatchPolicy, FixedBatch
from hvdtrain.precision import Precision
from hvdtrain.profile.memory import MemoryProfiler
from hvdtrain.state import OptimizerState, RngState, Session
from hvdtrain.step import LossFn, Outcome, StepFlags, checked, classification_loss, train_step
from hvdtrain.stop import StopSignals
from hvdtrain.watchdog import Watchdog
from hvdtrain.world import World


@dataclass
class FitResult:
    step: int
    epoch: int
    eval: dict[str, float] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    checkpoint: str | None = None
    mlflow_run_id: str | None = None  # rank 0's MLflow run, with log.mlflow
    skipped: int = 0  # optimizer steps skipped because the averaged gradient was not finite
    stopped: bool = False  # a stop signal ended the run early (hvdtrain/stop.py): exit EXIT_STOPPED


def evaluate(world: World, model: nn.Module, dataset: Dataset, loss_fn: LossFn, batch_size: int,
             loader: dict[str, Any] | None = None) -> dict[str, float]:
    """Loss and metrics over the whole `dataset`, sharded across ranks (DataLoader arguments
    `loader`, e.g. `data.loader_options`). All ranks must call."""
    model.eval()
    sums = MetricSums()
    with torch.no_grad():
        for batch in eval_loader(dataset, world, batch_size, loader):
            batch = to_device(batch, world.device)
            loss, batch_sums = checked(loss_fn(model, batch))
            sums.add(loss, batch_sums, batch_len(batch))
    model.train()
    # Rank 0 always holds sample 0, so its keys are the metric names; a rank with an empty shard
    # has none of its own but must still join the allreduce with the same shape.
    keys = world.broadcast_object(tuple(sums.sums), name="hvdtrain.eval.keys")
    return sums.reduce(world, "hvdtrain.eval", keys)


def fit(world: World, model: nn.Module, optimizer: torch.optim.Optimizer | None, train_set: Dataset,
        cfg: Config | None = None, eval_set: Dataset | None = None,
        loss_fn: LossFn = classification_loss) -> FitResult:
    """Train `model` data-parallel on `train_set`. All ranks must call with the same arguments.

    `optimizer` is built for one rank's batch (None: built from `cfg.optim`); its lr is scaled by
    `cfg.optim.lr_scaling`. `loss_fn(model, batch)` returns (mean loss, {metric: batch sum}).
    With `cfg.elastic.enabled`, workers may leave and join (hvdtrain/elastic.py runs `fit_once` in
    each world). With `cfg.parallel.pipeline_stages` S > 1 (world made by `World.init(groups=True)`,
    MPI controller), each rank trains one stage of `model`'s layers and frees the others' weights:
    afterwards `model` holds this rank's stage only (the checkpoint holds every stage).
    """
    cfg = cfg or Config()
    if cfg.elastic.enabled:
        from hvdtrain.elastic import fit_elastic  # imports Horovod's elastic runtime

        return fit_elastic(world, model, optimizer, train_set, cfg, eval_set, loss_fn, fit_once)
    tc = cfg.train
    with contextlib.ExitStack() as groups:
        split = _split(world, model, cfg, groups, lambda: (_first_micro_batch(train_set, tc.batch_size), loss_fn))
        sampler = ShardedBatchSampler(num_samples(train_set), split.data, tc.batch_size, tc.accumulation, cfg.seed,
                                      tc.shuffle, variable=cfg.adaptive.enabled)
        return fit_once(world, split.module, optimizer, train_set, cfg, eval_set, loss_fn, sampler, Session(), split)


@dataclass
class Split:
    """How the model is split over the world: `module`, what this rank trains; `data`, the ranks
    that share its batches and average its gradients; the step and the evaluation that run it; and
    `parts`, its parts of the registry. Data parallel: the whole model on every rank."""

    module: nn.Module
    data: World
    train_step: Callable[..., Outcome] = train_step
    evaluate: Callable[..., dict[str, float]] = evaluate
    parts: Callable[[Any, Any], tuple[dict[str, Any], dict[str, Any]]] = \
        lambda model, optimizer: ({"model": model, "optimizer": optimizer}, {})
    checkpoint: Callable[[nn.Module], Any] = checkpoint_blocks  # memory.activation_checkpointing


def _split(world: World, model: nn.Module, cfg: Config, cleanup: contextlib.ExitStack,
           sample: Callable[[], tuple[Any, LossFn]]) -> Split:
    if cfg.parallel.pipeline_stages == 1:
        return Split(model, world)
    # Imported here: mpi4py and the schedule load only for pipeline runs.
    from hvdtrain.parallel.pipeline import Pipeline

    pipe = Pipeline.build(world, model, cfg, cleanup, sample)
    # Its blocks were wrapped for activation checkpointing before the cut (the stage has no `blocks`).
    return Split(pipe.stage, pipe.data, pipe.train_step, pipe.evaluate,
                 lambda m, o: ({}, {"stage": pipe.stage_state(m, o)}), lambda m: None)


def fit_once(world: World, model: nn.Module, optimizer: torch.optim.Optimizer | None, train_set: Dataset,
             cfg: Config, eval_set: Dataset | None, loss_fn: LossFn, sampler: ShardedBatchSampler,
             session: Session, split: Split | None = None) -> FitResult:
    """One run in one world (an elastic run makes one per world, with its own session). All ranks call.
    `split` (from `fit`): the part of the model this rank trains; None: all of it."""
    seed_everything(cfg.seed + world.rank)
    # Undone on every exit path, an exception too: hooks left behind would launch collectives on the
    # user's next backward, and an elastic world's parts must leave the registry before the next world.
    with contextlib.ExitStack() as cleanup:
        return _train(_Run.build(world, model, optimizer, train_set, cfg, eval_set, loss_fn, sampler, session, cleanup,
                                 split or Split(model, world)))


@dataclass
class _Run:
    """What one call of the loop works with, built once per world."""

    world: World
    split: Split
    cfg: Config
    model: nn.Module
    optimizer: Any  # a torch optimizer, or ZeRO's sharded one
    clip: float  # the norm the loop clips the averaged gradient to (0: off, or the reducer clips)
    reducer: HookedBuckets
    codecs: FixedCodec | AutoSelect
    sampler: ShardedBatchSampler
    policy: BatchPolicy
    precision: Precision
    loss_fn: LossFn
    eval_set: Dataset | None
    session: Session
    ckpt: Checkpointer
    memprof: MemoryProfiler
    watchdog: Watchdog
    flags: StepFlags
    injector: FaultInjector

    @classmethod
    def build(cls, world: World, model: nn.Module, optimizer: torch.optim.Optimizer | None, train_set: Dataset,
              cfg: Config, eval_set: Dataset | None, loss_fn: LossFn, sampler: ShardedBatchSampler,
              session: Session, cleanup: contextlib.ExitStack, split: Split) -> _Run:
        """Make every part of the run; `cleanup` undoes what each one hooks, in reverse order."""
        cleanup.callback(session.end)
        model.to(world.device)
        if cfg.memory.activation_checkpointing:
            split.checkpoint(model)
        stop = StopSignals(cfg.train.stop_signals, cfg.train.stop_grace, world.rank)
        cleanup.callback(stop.close)
        injector = FaultInjector(cfg.faults, world.rank)
        injector.attach(model)
        cleanup.callback(injector.detach)
        codecs = codec_choice(split.data, cfg.comm.compression, cfg.comm.auto_steps)
        reducer = make_reducer(split.data, model, cfg, codecs.initial)
        cleanup.callback(reducer.remove)
        optimizer = _own_part(optimizer, model) if optimizer is not None else build_optimizer(model, cfg.optim)
        stepped, clip = reducer.prepare_optimizer(optimizer, cfg.optim.clip_grad_norm)
        precision = Precision.from_config(cfg.memory, world.device)
        policy = _policy(world, cfg, model, stepped, reducer, sampler, train_set, loss_fn, injector, precision)
        cleanup.callback(policy.close)
        registry = session.registry  # the one list of what a checkpoint saves and an elastic commit keeps
        shared, per_rank = split.parts(reducer.model_part(model), OptimizerState(stepped))
        registry.add_all({**shared, "sampler": sampler, **policy.parts()})
        for name, part in per_rank.items():
            registry.add_per_rank(name, part)
        registry.add("precision", precision, optional=True)
        registry.add_per_rank("reducer", reducer)
        registry.add_per_rank("rng", RngState(world))
        memprof = MemoryProfiler(world, cfg, model, stepped)
        cleanup.callback(memprof.close)
        watchdog = Watchdog(world.rank, cfg.train.stall_timeout)
        cleanup.callback(watchdog.stop)
        return cls(world, split, cfg, model, stepped, clip, reducer, codecs, sampler, policy, precision, loss_fn,
                   eval_set, session, Checkpointer(cfg.checkpoint, world), memprof, watchdog,
                   StepFlags(world, lambda: stop.requested), injector)


def _first_micro_batch(dataset: Dataset, size: int) -> Any:
    return default_collate([dataset[i] for i in range(min(size, num_samples(dataset)))])


def _own_part(optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
    """The user's optimizer, or (when `model` is this rank's pipeline stage) one of its class over the
    stage's parameters only, with the same groups and settings (its state is still empty here)."""
    mine = {id(p) for p in model.parameters()}
    groups = [{**g, "params": [p for p in g["params"] if id(p) in mine]} for g in optimizer.param_groups]
    if all(len(g["params"]) == len(o["params"]) for g, o in zip(groups, optimizer.param_groups)):
        return optimizer
    return type(optimizer)([g for g in groups if g["params"]], **optimizer.defaults)


def _policy(world: World, cfg: Config, model: nn.Module, optimizer: Any, reducer: HookedBuckets,
            sampler: ShardedBatchSampler, train_set: Dataset, loss_fn: LossFn, injector: FaultInjector,
            precision: Precision) -> BatchPolicy:
    if not cfg.adaptive.enabled:
        return FixedBatch(sampler, train_set, injector, cfg.train.on_oom, loader_options(cfg.data, world.device))
    # Imported here: the probe, the statistics and the goodput model load only for adaptive runs.
    from hvdtrain.adaptive.controller import AdaptiveController

    return AdaptiveController(world, cfg, model, optimizer, reducer, sampler, train_set, loss_fn, injector, precision)


def _train(r: _Run) -> FitResult:
    tc = r.cfg.train
    r.watchdog.beat("start: checkpoint restore and broadcast from rank 0", 0, collective=True)
    step, resumed = r.session.begin(lambda: _restore(r))
    total = r.sampler.num_samples // r.policy.base * tc.epochs
    total = min(total, tc.max_steps) if tc.max_steps else total
    # ranks x accumulation in a fixed world; an elastic run keeps its first world's global batch and lr.
    schedule = LRSchedule(r.optimizer, r.cfg.optim, r.policy.base // tc.batch_size, 1, total)
    log = TrainLog(r.world, r.cfg.log, total, step)
    _announce(r, log, step, total, schedule.factor, resumed)
    result = FitResult(step=step, epoch=r.sampler.epoch, history=log.run.history, checkpoint=resumed)
    seconds, skips_in_a_row = None, 0
    for epoch in range(r.sampler.epoch, tc.epochs):
        if result.stopped or r.policy.progress(step) >= total:
            break
        r.sampler.set_epoch(epoch)
        for micro_batches in r.policy.batches():
            lr = r.policy.set_lr(schedule, step)
            r.codecs.before_step(r.reducer, log, step, seconds)
            started = time.perf_counter()
            with r.memprof.step(step):
                finite = _step(r, micro_batches, log.sums, step)
            seconds, step = time.perf_counter() - started, step + 1
            skips_in_a_row = 0 if finite else _skipped(r, log, result, step, skips_in_a_row + 1)
            r.watchdog.beat("metrics allreduce (hvdtrain.train), evaluation or checkpoint", step, collective=True)
            samples = r.sampler.global_batch
            r.sampler.advance(samples)
            r.policy.after_step(step, log)  # a new batch size takes effect from the next step
            result.stopped = r.flags.stop  # a stop signal on any rank, known to all at this step
            done, end_of_epoch = result.stopped or r.policy.progress(step) >= total, r.sampler.epoch_done
            if end_of_epoch:
                r.sampler.set_epoch(epoch + 1)  # a checkpoint taken now resumes at the next epoch
            log.train_step_done(step, samples, done or end_of_epoch, r.reducer.sync_s, lr=lr, epoch=epoch)
            r.memprof.record(step, log, step % r.cfg.log.every == 0 or done or end_of_epoch)
            _evaluate_and_save(r, log, result, step, epoch, end_of_epoch, done)
            r.session.step_done(step, done)
            if done:
                break
    r.policy.finish()
    r.reducer.unshard()
    r.memprof.finish(log, step)
    log.event(step, "end", checkpoint=result.checkpoint, skipped=result.skipped, stopped=result.stopped)
    if result.stopped:
        # Every rank says so: cluster logs show that all of them stopped at the same step.
        print(f"hvdtrain: rank {r.world.rank}: stopped at step {step} on a stop signal; checkpoint "
              f"{result.checkpoint}; resume with --resume auto", file=sys.stderr, flush=True)
    log.close()
    result.step, result.epoch = step, r.sampler.epoch
    result.mlflow_run_id = log.run.tracker.run_id if log.run.tracker is not None else None
    return result


def _evaluate_and_save(r: _Run, log: TrainLog, result: FitResult, step: int, epoch: int, end_of_epoch: bool,
                       done: bool) -> None:
    """Evaluation and the checkpoint, when due (decided by step, config and agreed flags alone, so
    the same on every rank). A stop skips evaluation: a preempted job's grace period is short."""
    tc = r.cfg.train
    due = r.policy.eval_due(step, tc.eval_every) if tc.eval_every else end_of_epoch or done
    if r.eval_set is not None and due and not result.stopped:
        # Workers for one pass only: they would hold the eval set's memory between evaluations.
        loader = {**loader_options(r.cfg.data, r.world.device), "persistent_workers": False}
        # The micro-batch in force fits with a backward (an adaptive run's grows from a start that
        # can be 30x smaller than the user's batch).
        with r.reducer.full_parameters():
            result.eval = r.split.evaluate(r.world, r.model, r.eval_set, r.loss_fn, r.sampler.micro_batch, loader)
        log.evaluated(step, epoch, tc.epochs, result.eval)
    if r.ckpt.due(step, end_of_epoch, done):
        registry = r.session.registry
        saved = r.ckpt.save(step, registry.state_dict(), r.cfg.to_dict(), registry.rank_state_dict())
        log.event(step, "checkpoint", path=str(saved) if saved else None, saved=saved is not None)
        result.checkpoint = str(saved) if saved else result.checkpoint  # warn: the last good one stays


def _restore(r: _Run) -> tuple[int, str | None]:
    """The checkpoint `checkpoint.resume` names into every registered part (the same one on every
    rank), or, with none, rank 0's weights broadcast to all; (step, path). All ranks must call."""
    state = r.ckpt.restore(r.cfg.to_dict())
    if state is None:
        # Start from rank 0's weights and buffers. Optimizer state is not broadcast: it is empty on
        # every rank, and Horovod's broadcast_optimizer_state would run a zero-gradient step that
        # applies weight decay and advances Adam's counter (horovod#2805).
        r.reducer.broadcast_initial(r.model)
        return 0, None
    # Same verdict on every rank: restore() hands all ranks the same checkpoint.
    r.session.registry.load_state_dict(state, f"checkpoint {state['path']}")
    r.session.registry.load_rank_states(state["ranks"])
    return int(state["step"]), str(state["path"])


def _step(r: _Run, micro_batches: list[Any], sums: MetricSums, step: int) -> bool:
    """One optimizer step; its samples are retried, re-split by the policy, while some rank runs
    out of memory. True if it was applied (False: skipped on every rank)."""
    def beat(phase: str, collective: bool) -> None:
        r.watchdog.beat(phase, step, collective)

    r.injector.begin_step(step)
    while True:
        outcome = r.split.train_step(r.model, r.optimizer, r.reducer, micro_batches, r.loss_fn, sums, r.clip,
                                     r.world.device, beat, r.sampler.global_batch / r.split.data.size, r.precision,
                                     r.policy.hooks, r.flags)
        if outcome is not Outcome.RETRY:
            return outcome is Outcome.STEPPED
        if r.flags.local_oom:  # the rank to look at, in the cluster's logs
            print(f"hvdtrain: rank {r.world.rank}: out of memory at step {step + 1} "
                  f"(micro-batch {r.sampler.micro_batch})", file=sys.stderr, flush=True)
        micro_batches = r.policy.retry_after_oom(step + 1)


def _skipped(r: _Run, log: TrainLog, result: FitResult, step: int, in_a_row: int) -> int:
    """Count and log a skipped step; stop after `train.stop_after_skips` in a row. Every rank saw
    the same reduced gradient, so every rank gets here (and raises) at the same step."""
    result.skipped += 1
    report = r.precision.report()
    log.event(step, "skip", reason="non-finite averaged gradient", skipped=result.skipped, **report)
    scale = f"; fp16 loss scale now {report['loss_scale']:g}" if "loss_scale" in report else ""
    log.bar.write(f"hvdtrain: step {step} skipped on every rank: the averaged gradient is not finite "
                  f"(inf/NaN in some rank's gradient{scale}); {result.skipped} skipped so far")
    limit = r.cfg.train.stop_after_skips
    if limit and in_a_row >= limit:
        raise TrainingStopped(f"stopped at step {step}: {in_a_row} steps in a row had a non-finite averaged "
                              f"gradient (train.stop_after_skips={limit}); lower the learning rate, clip "
                              "gradients, or resume from an earlier checkpoint")
    return in_a_row


def _announce(r: _Run, log: TrainLog, step: int, total: int, factor: float, resumed: str | None) -> None:
    log.event(step, "start", world_size=r.world.size, global_batch=r.sampler.global_batch, steps=total,
              lr_factor=factor, resumed_from=resumed, config=r.cfg.to_dict())
    log.bar.write(f"hvdtrain: {r.world.size} rank(s), global batch {r.sampler.global_batch}, {total} steps, "
                  f"lr x{factor:g} ({r.cfg.optim.lr_scaling})" + (f", resumed from {resumed}" * bool(resumed)))
