"""`hvdtrain bench memory`: step time and memory per precision / activation-checkpointing variant
on one built-in task, same weights and batches. Rank 0 prints one JSON line per variant and one
per comparison with the first variant.

Variants run interleaved, `--rounds` times, so drift in machine load spreads over all of them. A
round times `--steps` real training steps (train_step: reducer, precision, optimizer) after
`--warmup` steps; a variant's time is the median of its round medians (slowest rank), with the
smallest and largest round median as the spread. Memory comes from one extra profiled step: the
profiler's hooks are not on the timed steps.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import time
from typing import Any

from hvdtrain.common import num_samples
from hvdtrain.config import TASKS
from hvdtrain.errors import ConfigError

VARIANTS = ("fp32", "fp32+ckpt", "bf16", "bf16+ckpt", "fp16", "fp16+ckpt")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--task", default="pylm", help=f"built-in task: {', '.join(TASKS)}")
    p.add_argument("--config", help="YAML or TOML config file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--variants", default="fp32,fp32+ckpt,bf16", help=f"comma-separated: {', '.join(VARIANTS)}")
    p.add_argument("--steps", type=int, default=5, help="timed steps per variant and round")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before each round's timed steps")
    p.add_argument("--rounds", type=int, default=3, help="interleaved repeats of all variants")


def run(args: argparse.Namespace) -> int:
    variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not variants:
        raise ConfigError(f"--variants {bad[0] if bad else ''!r} is not allowed; choose from {', '.join(VARIANTS)}")
    for flag in ("steps", "rounds"):
        if getattr(args, flag) < 1:
            raise ConfigError(f"--{flag} must be >= 1")
    from hvdtrain import config as config_mod
    from hvdtrain.world import World

    cfg = config_mod.build(args.config, list(args.overrides), task=args.task)
    memory(World.init(), cfg, variants, args.steps, max(args.warmup, 0), args.rounds)
    return 0


class _Runner:
    """One variant's model, optimizer, reducer and precision, reused across rounds."""

    def __init__(self, world: Any, cfg: Any, task: Any, initial: dict, variant: str) -> None:
        from hvdtrain.activations import checkpoint_blocks
        from hvdtrain.comm.reducer import GradReducer
        from hvdtrain.optim import build_optimizer
        from hvdtrain.precision import Precision

        precision, _, ckpt = variant.partition("+")
        self.world, self.task, self.variant = world, task, variant
        self.cfg = dataclasses.replace(cfg, memory=dataclasses.replace(cfg.memory, precision=precision,
                                                                       activation_checkpointing=bool(ckpt)))
        self.model = copy.deepcopy(task.model)
        self.model.load_state_dict(initial)
        self.model.to(world.device)
        if ckpt:
            checkpoint_blocks(self.model)
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.reducer = GradReducer(world, self.model.named_parameters(), cfg.comm.compression, cfg.comm.bucket_mb)
        self.precision = Precision.from_config(self.cfg.memory, world.device)

    def step(self, batch: Any) -> None:
        from hvdtrain.metrics import MetricSums
        from hvdtrain.step import train_step

        train_step(self.model, self.optimizer, self.reducer, [batch], self.task.loss_fn, MetricSums(),
                   self.cfg.optim.clip_grad_norm, self.world.device, precision=self.precision)

    def time(self, batches: list, warmup: int) -> float:
        import torch

        times = []
        for i, batch in enumerate(batches):
            self.world.barrier()
            start = time.perf_counter()
            self.step(batch)
            if self.world.device.type == "cuda":
                torch.cuda.synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - start)
        return statistics.median(times)

    def profile(self, batch: Any) -> dict[str, int]:
        from hvdtrain.profile.memory import MemoryProfiler

        cfg = dataclasses.replace(self.cfg, memory=dataclasses.replace(self.cfg.memory, profile=True),
                                  log=dataclasses.replace(self.cfg.log, dir=""))
        prof = MemoryProfiler(self.world, cfg, self.model, self.optimizer)
        with prof.step(0):
            self.step(batch)
        prof.close()
        return dict(prof.figures)


def memory(world: Any, cfg: Any, variants: list[str], steps: int, warmup: int, rounds: int) -> list[dict]:
    """Time and profile each variant; rank 0 prints the records. All ranks call."""
    import torch

    from hvdtrain.bench.allreduce import emit
    from hvdtrain.data import ShardedBatchSampler, train_loader
    from hvdtrain.tasks import build_task
    from hvdtrain.tasks.models import count_parameters

    task = build_task(cfg)
    sampler = ShardedBatchSampler(num_samples(task.train_set), world, cfg.train.batch_size, 1, cfg.seed)
    batches = [b for b, _ in zip(train_loader(task.train_set, sampler), range(warmup + steps))]
    initial = copy.deepcopy(task.model.state_dict())
    runners = [_Runner(world, cfg, task, initial, v) for v in variants]
    medians: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(rounds):
        for r in runners:
            local = torch.tensor([r.time(batches, warmup)], dtype=torch.float64)
            medians[r.variant].append(float(world.allreduce(local, name=f"bench.mem.{r.variant}", op="max")))
    results = []
    for r in runners:
        figures = r.profile(batches[0])
        spread = medians[r.variant]
        record = {"bench": "memory", "task": cfg.task, "np": world.size, "variant": r.variant,
                  "params": count_parameters(task.model), "batch_size": cfg.train.batch_size,
                  "step_s": statistics.median(spread), "step_min_s": min(spread), "step_max_s": max(spread),
                  "rounds": rounds, "steps_per_round": steps, **{f"{k}_bytes": v for k, v in figures.items()
                                                                  if isinstance(v, int) and not isinstance(v, bool)}}
        r.reducer.remove()
        results.append(record)
        emit(world, record)
    base = results[0]
    for rec in results[1:]:
        emit(world, {"bench": "memory-vs-" + base["variant"], "variant": rec["variant"],
                     "time_ratio": rec["step_s"] / base["step_s"],
                     "activation_reduction": base["activations_bytes"] / max(rec["activations_bytes"], 1),
                     "peak_ratio": rec["peak_bytes"] / base["peak_bytes"]})
    return results
