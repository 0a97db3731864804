"""`hvdtrain bench memory`: step time and memory per precision / activation-checkpointing / ZeRO
variant on one built-in task, same weights and batches. Rank 0 prints one JSON line per variant and
one per comparison with the first variant.

A variant is a precision with optional parts joined by "+": `ckpt` (activation checkpointing), `z1`,
`z2` or `z3` (ZeRO stage), `pfK` (ZeRO-3 prefetch depth K, default 1): e.g. `fp32+z2`, `fp32+z3+pf0`.
ZeRO-3 variants also report the time per step spent waiting for parameter allgathers; beside a
`+pf0` variant (every gather waited for in full) that gives the share of gather time prefetch hid.

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

PRECISIONS = ("fp32", "bf16", "fp16")
PARTS = ("ckpt", "z1", "z2", "z3", "pf0", "pf1", "pf2", "pf3")


def parse_variant(text: str) -> dict[str, Any]:
    """{'precision', 'ckpt', 'zero_stage', 'prefetch'} of a variant name, or ConfigError."""
    precision, *parts = text.split("+")
    stages = [int(p[1]) for p in parts if p in ("z1", "z2", "z3")]
    prefetch = [int(p[2]) for p in parts if p.startswith("pf") and p in PARTS]
    if precision not in PRECISIONS or any(p not in PARTS for p in parts) or len(stages) > 1 or len(prefetch) > 1 \
            or (prefetch and stages != [3]) or len(set(parts)) != len(parts):
        raise ConfigError(f"--variants {text!r} is not allowed; a precision ({', '.join(PRECISIONS)}) and optional "
                          "+ckpt, +z1|+z2|+z3, +pfK (with z3, K 0-3)")
    return {"precision": precision, "ckpt": "ckpt" in parts, "zero_stage": stages[0] if stages else 0,
            "prefetch": prefetch[0] if prefetch else 1}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--task", default="pylm", help=f"built-in task: {', '.join(TASKS)}")
    p.add_argument("--config", help="YAML or TOML config file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--variants", default="fp32,fp32+ckpt,bf16",
                   help="comma-separated precision[+ckpt][+z1|+z2|+z3][+pfK], e.g. fp32+z2,fp32+z3,fp32+z3+pf0")
    p.add_argument("--steps", type=int, default=5, help="timed steps per variant and round")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before each round's timed steps")
    p.add_argument("--rounds", type=int, default=3, help="interleaved repeats of all variants")


def run(args: argparse.Namespace) -> int:
    variants = [v for v in args.variants.split(",") if v]
    if not variants:
        raise ConfigError("--variants '' is not allowed; give at least one, e.g. fp32,fp32+z3")
    for v in variants:
        parse_variant(v)
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
        from hvdtrain.comm.build import make_reducer
        from hvdtrain.optim import build_optimizer
        from hvdtrain.precision import Precision

        v = parse_variant(variant)
        self.world, self.task, self.variant = world, task, variant
        # The bench's steps have no OOM retry (train_step without a policy's hooks).
        memory_cfg = dataclasses.replace(cfg.memory, precision=v["precision"], activation_checkpointing=v["ckpt"],
                                         zero_stage=v["zero_stage"], zero3_prefetch=v["prefetch"])
        self.cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, on_oom="stop"), memory=memory_cfg)
        self.model = copy.deepcopy(task.model)
        self.model.load_state_dict(initial)
        self.model.to(world.device)
        if v["ckpt"]:
            checkpoint_blocks(self.model)
        self.reducer = make_reducer(world, self.model, self.cfg)
        self.optimizer: Any
        self.optimizer, self.clip = self.reducer.prepare_optimizer(build_optimizer(self.model, cfg.optim),
                                                                   cfg.optim.clip_grad_norm)
        self.precision = Precision.from_config(self.cfg.memory, world.device)
        self.gather_wait: list[float] = []  # ZeRO-3: seconds per step waiting for allgathers, per round

    def step(self, batch: Any) -> None:
        from hvdtrain.metrics import MetricSums
        from hvdtrain.step import train_step

        train_step(self.model, self.optimizer, self.reducer, [batch], self.task.loss_fn, MetricSums(),
                   self.clip, self.world.device, precision=self.precision)

    def time(self, batches: list, warmup: int) -> float:
        import torch

        times, waited = [], 0.0
        for i, batch in enumerate(batches):
            self.world.barrier()
            before = getattr(self.reducer, "gather_wait_s", 0.0)
            start = time.perf_counter()
            self.step(batch)
            if self.world.device.type == "cuda":
                torch.cuda.synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - start)
                waited += getattr(self.reducer, "gather_wait_s", 0.0) - before
        self.gather_wait.append(waited / max(len(times), 1))
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
        if r.cfg.memory.zero_stage == 3:
            record["gather_wait_s"] = statistics.median(r.gather_wait)  # rank 0's, per step
        r.reducer.remove()
        results.append(record)
        emit(world, record)
    _hidden(world, results)
    base = results[0]
    for rec in results[1:]:
        emit(world, {"bench": "memory-vs-" + base["variant"], "variant": rec["variant"],
                     "time_ratio": rec["step_s"] / base["step_s"],
                     "activation_reduction": base["activations_bytes"] / max(rec["activations_bytes"], 1),
                     "peak_ratio": rec["peak_bytes"] / base["peak_bytes"]})
    return results


def _hidden(world: Any, results: list[dict]) -> None:
    """For each ZeRO-3 variant with prefetch beside the same variant at +pf0: the share of gather
    time prefetch hid (1 - waited with prefetch / waited without)."""
    from hvdtrain.bench.allreduce import emit

    plain = {r["variant"].replace("+pf0", ""): r for r in results if "+pf0" in r["variant"]}
    for rec in results:
        base = plain.get(rec["variant"].split("+pf")[0])
        if base is None or rec is base or "gather_wait_s" not in rec or not base["gather_wait_s"]:
            continue
        emit(world, {"bench": "zero3-prefetch", "variant": rec["variant"], "vs": base["variant"],
                     "gather_wait_s": rec["gather_wait_s"], "gather_wait_without_prefetch_s": base["gather_wait_s"],
                     "hidden": 1 - rec["gather_wait_s"] / base["gather_wait_s"],
                     "time_ratio": rec["step_s"] / base["step_s"]})
