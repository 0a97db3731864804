"""`hvdtrain bench pipeline`: pipeline stages against data parallelism on one built-in task, under
`horovodrun --mpi`. A variant SxM runs S stages (N/S replicas) over M micro-batches per step, each
of `train.batch_size` samples per replica; S=1 is plain data parallelism with M-step accumulation.

Per variant, rank 0 prints one JSON line: the step time (median of round medians, slowest rank),
samples per second, the stage idle share measured as the time each rank spends blocked in pipeline
receives over its step time (largest and mean over ranks) beside the ideal bubble (S-1)/(M+S-1),
the parameter bytes per rank (largest) beside P/S (a tied weight adds itself to the first and last
stage), and per rank the peak bytes of activations alive at once beside A_s x min(S - s, M) for
1F1B at stage s (A_s x M for GPipe; A_s at S=1), where A_s is the stage's activations of one
micro-batch, measured by a one-micro-batch step. Variants run interleaved, `--rounds` times.
`--set memory.activation_checkpointing=true` checkpoints the blocks in every variant.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import statistics
import time
from typing import Any

from hvdtrain.config import TASKS
from hvdtrain.errors import ConfigError


def parse_variant(text: str) -> tuple[int, int]:
    """"2x4" -> (stages 2, micro-batches 4), or ConfigError."""
    s, _, m = text.partition("x")
    if not (s.isdigit() and m.isdigit() and int(s) >= 1 and int(m) >= 1):
        raise ConfigError(f"--variants {text!r} is not allowed; give SxM: stages x micro-batches, e.g. 1x2,2x4")
    return int(s), int(m)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--task", default="pylm", help=f"built-in task: {', '.join(TASKS)}")
    p.add_argument("--config", help="YAML or TOML config file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--variants", default="1x2,2x2,2x4,2x8", help="comma-separated SxM (stages x micro-batches)")
    p.add_argument("--schedule", default="1f1b", choices=("1f1b", "gpipe"))
    p.add_argument("--steps", type=int, default=5, help="timed steps per variant and round")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before each round's timed steps")
    p.add_argument("--rounds", type=int, default=3, help="interleaved repeats of all variants")


def run(args: argparse.Namespace) -> int:
    variants = [parse_variant(v) for v in args.variants.split(",") if v]
    if not variants:
        raise ConfigError("--variants '' is not allowed; give at least one SxM, e.g. 2x4")
    for flag in ("steps", "rounds"):
        if getattr(args, flag) < 1:
            raise ConfigError(f"--{flag} must be >= 1")
    from hvdtrain import config as config_mod
    from hvdtrain.world import World

    cfg = config_mod.build(args.config, list(args.overrides), task=args.task)
    world = World.init(groups=True)
    bad = [f"{s}x{m}" for s, m in variants if world.size % s]
    if bad:
        raise ConfigError(f"--variants {bad[0]}: {bad[0].split('x')[0]} stages do not divide {world.size} ranks")
    pipeline(world, cfg, variants, args.schedule, args.steps, max(args.warmup, 0), args.rounds)
    return 0


class _Runner:
    """This rank's part of the model at S stages, its reducer, optimizer and step; the variants of
    one S share it (a stage's process sets can exist once)."""

    def __init__(self, world: Any, cfg: Any, task: Any, initial: dict, stages: int, schedule: str,
                 cleanup: contextlib.ExitStack) -> None:
        from hvdtrain.activations import checkpoint_blocks
        from hvdtrain.comm.build import make_reducer
        from hvdtrain.optim import build_optimizer
        from hvdtrain.parallel.pipeline import Pipeline
        from hvdtrain.precision import Precision
        from hvdtrain.step import StepFlags, train_step

        self.world, self.task, self.stages = world, task, stages
        parallel = dataclasses.replace(cfg.parallel, pipeline_stages=stages, schedule=schedule)
        self.cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, on_oom="stop"), parallel=parallel)
        model = copy.deepcopy(task.model)
        model.load_state_dict(initial)
        if stages == 1 and cfg.memory.activation_checkpointing:
            checkpoint_blocks(model)  # Pipeline.build does it for S > 1
        self.pipe = Pipeline.build(world, model, self.cfg, cleanup) if stages > 1 else None
        self.model = (self.pipe.stage if self.pipe else model).to(world.device)
        self.data = self.pipe.data if self.pipe else world
        self.reducer = make_reducer(self.data, self.model, self.cfg)
        cleanup.callback(self.reducer.remove)
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.precision = Precision.from_config(self.cfg.memory, world.device)
        self.flags = StepFlags(world)
        self.step_fn = self.pipe.train_step if self.pipe else train_step

    def step(self, micro_batches: list[Any]) -> None:
        from hvdtrain.metrics import MetricSums

        self.step_fn(self.model, self.optimizer, self.reducer, micro_batches, self.task.loss_fn, MetricSums(), 0.0,
                     self.world.device, precision=self.precision, flags=self.flags)

    def time(self, batches: list[list[Any]], warmup: int) -> tuple[float, float]:
        """(median step seconds, this rank's share of them blocked in pipeline receives)."""
        times, waited = [], 0.0
        for i, micro_batches in enumerate(batches):
            self.world.barrier()
            before = self.pipe.link.wait_s if self.pipe else 0.0
            start = time.perf_counter()
            self.step(micro_batches)
            if i >= warmup:
                times.append(time.perf_counter() - start)
                waited += (self.pipe.link.wait_s if self.pipe else 0.0) - before
        return statistics.median(times), waited / sum(times)

    def memory(self, micro_batches: list[Any]) -> tuple[int, int]:
        """(parameter bytes, peak bytes of activations alive at once) of one step on this rank."""
        from hvdtrain.profile.memory import LiveActivations, storage_bytes

        meter = LiveActivations([*self.model.parameters(), *self.model.buffers()])
        with meter.measure():
            self.step(micro_batches)
        return storage_bytes(p for p in self.model.parameters() if p.numel()), meter.peak


def pipeline(world: Any, cfg: Any, variants: list[tuple[int, int]], schedule: str, steps: int, warmup: int,
             rounds: int) -> list[dict]:
    """Time and measure each variant; rank 0 prints the records. All ranks call."""
    import torch

    from hvdtrain.bench.allreduce import emit
    from hvdtrain.common import num_samples
    from hvdtrain.data import ShardedBatchSampler, train_loader
    from hvdtrain.tasks import build_task
    from hvdtrain.tasks.models import count_parameters

    task = build_task(cfg)
    initial = copy.deepcopy(task.model.state_dict())
    params_total = sum(t.numel() * t.element_size() for t in {id(p): p for p in task.model.parameters()}.values())
    results = []
    with contextlib.ExitStack() as cleanup:
        parts = {s: _Runner(world, cfg, task, initial, s, schedule, cleanup) for s in sorted({s for s, _ in variants})}
        names = [f"{s}x{m}" for s, m in variants]
        feeds = {}
        for (s, m), name in zip(variants, names):
            sampler = ShardedBatchSampler(num_samples(task.train_set), parts[s].data, cfg.train.batch_size, m,
                                          cfg.seed)
            loader = iter(train_loader(task.train_set, sampler))
            feeds[name] = [[next(loader) for _ in range(m)] for _ in range(warmup + steps)]
        medians: dict[str, list[float]] = {name: [] for name in names}
        idle: dict[str, list[list[float]]] = {name: [] for name in names}
        for _ in range(rounds):
            for (s, _m), name in zip(variants, names):
                step_s, share = parts[s].time(feeds[name], warmup)
                local = torch.tensor([step_s], dtype=torch.float64)
                medians[name].append(float(world.allreduce(local, name=f"bench.pipe.{name}", op="max")))
                idle[name].append(world.allgather_object(share, name=f"bench.pipe.idle.{name}"))
        for (stages, m), name in zip(variants, names):
            r = parts[stages]
            params, acts = r.memory(feeds[name][0])
            _, one = r.memory(feeds[name][0][:1])  # this stage's activations of one micro-batch
            stage = world.rank % stages
            alive = m if schedule == "gpipe" or stages == 1 else min(stages - stage, m)
            per_rank = world.allgather_object((params, acts, one * (1 if stages == 1 else alive)),
                                              name=f"bench.pipe.mem.{name}")
            shares = [statistics.median(col) for col in zip(*idle[name])]  # per rank, median over rounds
            spread = medians[name]
            replicas = world.size // stages
            record = {"bench": "pipeline", "task": cfg.task, "np": world.size, "variant": name,
                      "stages": stages, "replicas": replicas, "micro_batches": m, "schedule": schedule,
                      "params": count_parameters(task.model), "batch_size": cfg.train.batch_size,
                      "global_batch": replicas * m * cfg.train.batch_size,
                      "step_s": statistics.median(spread), "step_min_s": min(spread), "step_max_s": max(spread),
                      "samples_per_s": replicas * m * cfg.train.batch_size / statistics.median(spread),
                      "idle_share_max": max(shares), "idle_share_mean": statistics.mean(shares),
                      "bubble_formula": (stages - 1) / (m + stages - 1),
                      "param_bytes_max": max(p for p, _, _ in per_rank), "param_bytes_formula": params_total / stages,
                      "activation_bytes_by_rank": [a for _, a, _ in per_rank],
                      "activation_bytes_formula_by_rank": [f for _, _, f in per_rank],
                      "rounds": rounds, "steps_per_round": steps}
            results.append(record)
            emit(world, record)
    return results
