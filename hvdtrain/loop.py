"""The training loop: plain code, top to bottom.

Collective order per optimizer step, identical on every rank: the gradient buckets the reducer
launches during the k-th micro-batch's backward, then, on logging steps only, one metrics
allreduce; at evaluation and checkpoint steps, their named collectives. Which steps those are
depends only on the step counter and config, never on rank-local state, so ranks cannot diverge.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from hvdtrain.activations import checkpoint_blocks
from hvdtrain.adaptive import controller as adaptive
from hvdtrain.checkpoint import Checkpointer, restore_or_broadcast
from hvdtrain.comm.compression import AutoSelect
from hvdtrain.comm.reducer import GradReducer
from hvdtrain.comm.zero import ZeroReducer
from hvdtrain.config import Config
from hvdtrain.data import ShardedBatchSampler, eval_loader, train_loader
from hvdtrain.errors import TrainingStopped
from hvdtrain.metrics import MetricSums, TrainLog
from hvdtrain.optim import LRSchedule, build_optimizer
from hvdtrain.precision import Precision
from hvdtrain.profile.memory import MemoryProfiler, nvtx_range
from hvdtrain.tasks import LossFn, classification_loss
from hvdtrain.watchdog import Watchdog
from hvdtrain.world import World


@dataclass
class FitResult:
    step: int
    epoch: int
    eval: dict[str, float] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    checkpoint: str | None = None
    skipped: int = 0  # optimizer steps skipped because the averaged gradient was not finite


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


_FP32 = Precision()  # stateless in fp32: one for every call that passes no precision


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    return batch


def _batch_len(batch: Any) -> int:
    while isinstance(batch, (list, tuple, dict)):
        batch = batch[0] if not isinstance(batch, dict) else next(iter(batch.values()))
    return len(batch)


def _groups(batches: Iterable[Any], k: int) -> Iterator[list[Any]]:
    group: list[Any] = []
    for batch in batches:
        group.append(batch)
        if len(group) == k:
            yield group
            group = []


def evaluate(world: World, model: nn.Module, dataset: Dataset, loss_fn: LossFn, batch_size: int) -> dict[str, float]:
    """Loss and metrics over the whole `dataset`, sharded across ranks. All ranks must call."""
    model.eval()
    sums = MetricSums()
    with torch.no_grad():
        for batch in eval_loader(dataset, world, batch_size):
            batch = _to_device(batch, world.device)
            loss, batch_sums = loss_fn(model, batch)
            sums.add(loss, batch_sums, _batch_len(batch))
    model.train()
    # Rank 0 always holds sample 0, so its keys are the metric names; a rank with an empty shard
    # has none of its own but must still join the allreduce with the same shape.
    keys = world.broadcast_object(tuple(sums.sums), name="hvdtrain.eval.keys")
    return sums.reduce(world, "hvdtrain.eval", keys)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, reducer: GradReducer, micro_batches: list[Any],
               loss_fn: LossFn, sums: MetricSums, clip: float, device: torch.device,
               beat: Callable[[str, bool], None] = lambda phase, collective: None,
               rank_samples: float | None = None, precision: Precision | None = None) -> bool:
    """One optimizer step over k micro-batches; the reducer averages gradients as the k-th backward
    produces them. Returns False (and leaves the weights alone) if the averaged gradient is not finite.

    `rank_samples` (global batch / ranks): each micro-batch's mean loss is weighted by its size over
    it, which keeps the average exact when shares are uneven; None: equal micro-batches, weight 1/k."""
    precision = precision or _FP32
    for j, batch in enumerate(micro_batches):
        beat(f"forward/backward of micro-batch {j} (loss_fn)", False)
        reducer.arm(last_micro_batch=j == len(micro_batches) - 1)
        batch = _to_device(batch, device)
        with precision.forward():
            loss, batch_sums = loss_fn(model, batch)
        divisor = rank_samples / _batch_len(batch) if rank_samples else len(micro_batches)
        precision.backward(loss / divisor if divisor != 1 else loss)  # no autograd node for a no-op
        sums.add(loss, batch_sums, _batch_len(batch))
    beat("gradient allreduce (hvdtrain.grad.*)", True)
    with nvtx_range("allreduce wait"):
        finite = reducer.synchronize()
    # Horovod's mixed-precision order: synchronize, then unscale, clip and step without re-reducing.
    # Only unscaling and clipping touch every parameter; walking the module tree each step for
    # nothing cost ~0.02 ms of a 2.3 ms digits step.
    params = list(model.parameters()) if clip > 0 or precision.scaler is not None else []
    precision.step(optimizer, params, finite, clip, reducer)
    reducer.zero_grad(optimizer)  # GradReducer zeroes its buckets in place: the grads are their views
    return finite


def _check_skips(in_a_row: int, limit: int, step: int) -> None:
    # Every rank saw the same reduced gradient, so every rank raises at the same step.
    if limit and in_a_row >= limit:
        raise TrainingStopped(f"stopped at step {step}: {in_a_row} steps in a row had a non-finite averaged "
                              f"gradient (train.stop_after_skips={limit}); lower the learning rate, clip "
                              "gradients, or resume from an earlier checkpoint")


def _choose_codec(world: World, reducer: GradReducer, auto: AutoSelect | None, log: TrainLog, step: int,
                  seconds: float | None) -> None:
    """compression=auto: set the codec for the next step; after the trial, log which won and why."""
    if auto is None or auto.codec_for_next_step() is None:
        return
    if seconds is not None and auto.record(seconds):
        choice = auto.decide(world)
        reducer.set_codec(choice)
        why = ", ".join(f"{c} {t * 1e3:.1f} ms" for c, t in auto.medians.items())
        log.event(step, "compression", choice=choice, median_step_ms={c: t * 1e3 for c, t in auto.medians.items()})
        log.bar.write(f"hvdtrain: compression=auto chose {choice} (median step: {why})")
        return
    reducer.set_codec(auto.codec_for_next_step())


def fit(world: World, model: nn.Module, optimizer: torch.optim.Optimizer | None, train_set: Dataset,
        cfg: Config | None = None, eval_set: Dataset | None = None,
        loss_fn: LossFn = classification_loss) -> FitResult:
    """Train `model` data-parallel on `train_set`. All ranks must call with the same arguments.

    `optimizer` is built for one rank's batch (None: built from `cfg.optim`); its lr is scaled by
    `cfg.optim.lr_scaling`. `loss_fn(model, batch)` returns (mean loss, {metric: batch sum}).
    With `cfg.elastic.enabled`, workers may leave and join (hvdtrain/elastic.py).
    """
    cfg = cfg or Config()
    if cfg.elastic.enabled:
        from hvdtrain.elastic import fit_elastic  # imports Horovod's elastic runtime, and this module

        return fit_elastic(world, model, optimizer, train_set, cfg, eval_set, loss_fn)
    return fit_once(world, model, optimizer, train_set, cfg, eval_set, loss_fn)


def fit_once(world: World, model: nn.Module, optimizer: torch.optim.Optimizer | None, train_set: Dataset,
             cfg: Config, eval_set: Dataset | None, loss_fn: LossFn, elastic: Any = None) -> FitResult:
    """One run in one world (an elastic run makes one per world; `elastic` is its Session)."""
    model.to(world.device)
    if cfg.memory.activation_checkpointing:
        checkpoint_blocks(model)
    auto = AutoSelect(cfg.comm.auto_steps) if cfg.comm.compression == "auto" else None
    codec = "none" if auto else cfg.comm.compression
    if cfg.memory.zero_stage:
        reducer = ZeroReducer(world, model.named_parameters(), cfg.memory.zero_stage, codec, cfg.comm.bucket_mb,
                              cfg.comm.error_feedback, cfg.optim.clip_grad_norm)
    else:
        reducer = GradReducer(world, model.named_parameters(), codec, cfg.comm.bucket_mb, cfg.comm.error_feedback)
    watchdog = Watchdog(world.rank, cfg.train.stall_timeout)
    try:
        return _fit(world, model, optimizer, train_set, cfg, eval_set, loss_fn, reducer, auto, watchdog, elastic)
    finally:
        # Also on an exception: hooks left behind would launch collectives on the user's next backward.
        watchdog.stop()
        reducer.remove()


def _fit(world: World, model: nn.Module, optimizer: torch.optim.Optimizer | None, train_set: Dataset,
         cfg: Config, eval_set: Dataset | None, loss_fn: LossFn, reducer: GradReducer, auto: AutoSelect | None,
         watchdog: Watchdog, elastic: Any) -> FitResult:
    tc = cfg.train
    seed_everything(cfg.seed + world.rank)
    sampler = elastic.sampler if elastic else ShardedBatchSampler(len(train_set), world, tc.batch_size,
                                                                  tc.accumulation, cfg.seed, tc.shuffle)
    optimizer = optimizer or build_optimizer(model, cfg.optim)
    if isinstance(reducer, ZeroReducer):  # it steps this rank's shard and clips by the global norm
        optimizer, clip = reducer.shard_optimizer(optimizer), 0.0
    else:
        clip = cfg.optim.clip_grad_norm
    ckpt = Checkpointer(cfg.checkpoint, world)
    precision, memprof = Precision.from_config(cfg.memory, world.device), MemoryProfiler(world, cfg, model, optimizer)
    ctl = adaptive.AdaptiveController(world, cfg, model, optimizer, reducer, sampler, train_set, loss_fn,
                                      train_step) if cfg.adaptive.enabled else None
    if ctl and elastic:
        elastic.adaptive.attach(ctl)  # a later world's controller takes over the last one's state
    watchdog.beat("start: checkpoint restore and broadcast from rank 0", 0, collective=True)
    restore = partial(restore_or_broadcast, world, model, optimizer, reducer, sampler, ckpt, cfg.to_dict(),
                      precision, ctl)
    step, resumed = elastic.begin(restore) if elastic else restore()
    # The starting global batch: adaptive runs count progress and scale the lr against it.
    base = ctl.base if ctl else sampler.global_batch
    total = sampler.num_samples // base * tc.epochs
    total = min(total, tc.max_steps) if tc.max_steps else total
    # ranks x accumulation in a fixed world; an elastic run keeps its first world's global batch and lr.
    schedule = LRSchedule(optimizer, cfg.optim, base // tc.batch_size, 1, total)
    log = TrainLog(world, cfg.log, total, step)
    log.event(step, "start", world_size=world.size, global_batch=sampler.global_batch, steps=total,
              lr_factor=schedule.factor, resumed_from=resumed, config=cfg.to_dict())
    log.bar.write(f"hvdtrain: {world.size} rank(s), global batch {sampler.global_batch}, {total} steps, "
                  f"lr x{schedule.factor:g} ({cfg.optim.lr_scaling})" + (f", resumed from {resumed}" * bool(resumed)))
    result = FitResult(step=step, epoch=sampler.epoch, history=log.run.history, checkpoint=resumed)
    step_seconds, skips_in_a_row = None, 0
    for epoch in range(sampler.epoch, tc.epochs):
        if (ctl.progress if ctl else step) >= total:
            break
        sampler.set_epoch(epoch)
        steps = ctl.batches() if ctl else _groups(train_loader(train_set, sampler), sampler.accumulation)
        for micro_batches in steps:
            lr = ctl.apply_lr(schedule) if ctl else schedule.apply(step)
            _choose_codec(world, reducer, auto, log, step, step_seconds)
            started = time.perf_counter()
            step_fn = ctl.train_step if ctl else train_step
            with memprof.step(step):
                finite = step_fn(model, optimizer, reducer, micro_batches, loss_fn, log.sums, clip,
                                 world.device, lambda phase, c, s=step: watchdog.beat(phase, s, c),
                                 sampler.global_batch / world.size, precision)
            step_seconds = time.perf_counter() - started
            step += 1
            skips_in_a_row = 0 if finite else skips_in_a_row + 1
            if not finite:
                result.skipped += 1
                log.event(step, "skip", reason="non-finite averaged gradient", skipped=result.skipped,
                          **precision.report())
                _check_skips(skips_in_a_row, tc.stop_after_skips, step)
            watchdog.beat("metrics allreduce (hvdtrain.train), evaluation or checkpoint", step, collective=True)
            samples = sampler.global_batch
            sampler.advance(samples)
            if ctl:
                ctl.after_step(step, log)  # a new batch size takes effect from the next step
            done, end_of_epoch = (ctl.progress if ctl else step) >= total, sampler.epoch_done
            if end_of_epoch:
                sampler.set_epoch(epoch + 1)  # a checkpoint taken now resumes at the next epoch
            log.train_step_done(step, samples, done or end_of_epoch, lr=lr, epoch=epoch)
            memprof.record(step, log, step % cfg.log.every == 0 or done or end_of_epoch)
            if tc.eval_every:  # in B0-steps of samples when the batch changes (adaptive)
                eval_now = ctl.due(tc.eval_every) if ctl else step % tc.eval_every == 0
            else:
                eval_now = end_of_epoch or done
            if eval_set is not None and eval_now:
                # The micro-batch in force fits with a backward (the sampler's: an adaptive run's grows, and
                # its starting one can be 30x smaller).
                result.eval = evaluate(world, model, eval_set, loss_fn, sampler.micro_batch)
                log.evaluated(step, epoch, tc.epochs, result.eval)
            if ckpt.due(step, end_of_epoch, done):
                state = {"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                         "sampler": sampler.state_dict(), "precision": precision.state_dict(),
                         **({"adaptive": ctl.state_dict()} if ctl else {})}
                result.checkpoint = str(ckpt.save(step, state, cfg.to_dict(), {"reducer": reducer.state_dict()}))
            if elastic:
                elastic.step_done(step, done)
            if done:
                break
    if ctl:
        ctl.finish()
    memprof.finish(log, step)
    log.event(step, "end", checkpoint=result.checkpoint, skipped=result.skipped)
    log.close()
    result.step, result.epoch = step, sampler.epoch
    return result
