"""hvdtrain's step against the hand-written Horovod loop, interleaved in one process.

`hvdtrain bench train` launches each way separately, and on a shared machine launch-to-launch
noise (±25% on 4 December) hides a few percent. Here both ways live in one process on the same
batches: blocks of steps alternate (ABAB, then BABA, ...) so drift in machine speed hits both
alike, and the result is the median of per-round ratios. One JSON line per task.

`--tasks fixed` measures what each way adds per step regardless of the model: a one-layer 8x8 model
on 4 samples, so the step is almost all framework, beside the same step in plain PyTorch.

    horovodrun -np 1 --gloo python benchmarks/step_overhead.py --tasks digits,pylm
    horovodrun -np 1 --mpi  python benchmarks/step_overhead.py --tasks digits,pylm
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
from torch import nn

from hvdtrain import config as config_mod
from hvdtrain.bench.baseline import horovod_optimizer, horovod_step, plain_step
from hvdtrain.bench.loops import batches, hvdtrain_step, hvdtrain_world
from hvdtrain.comm.reducer import GradReducer
from hvdtrain.metrics import MetricSums
from hvdtrain.tasks import build_task
from hvdtrain.world import World


def _block(step: Any, batches: list[Any], start: int, count: int) -> float:
    """Median seconds per step over `count` steps (the next batches, wrapping)."""
    times = []
    for i in range(count):
        t = time.perf_counter()
        step(batches[(start + i) % len(batches)])
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _interleaved(steps: dict[str, Any], batches: list[Any], rounds: int, block: int) -> dict[str, list[float]]:
    """Each way's median seconds per step in each round's block; the order of the ways reverses
    every round, so drift in the machine's speed hits every way alike."""
    for step in steps.values():  # warm-up: allocator, autograd graph, Horovod's first collectives
        _block(step, batches, 0, max(10, block // 10))
    ways = list(steps)
    per: dict[str, list[float]] = {way: [] for way in ways}
    for r in range(rounds):
        for way in ways if r % 2 == 0 else ways[::-1]:
            per[way].append(_block(steps[way], batches, r * block, block))
    return per


def measure(world: World, task_name: str, rounds: int, block: int) -> dict[str, Any]:
    cfg = config_mod.build(None, [], task=task_name)
    steps, tasks = {}, []
    for way, make in (("hvdtrain", hvdtrain_step), ("horovod", horovod_step)):
        tasks.append(build_task(cfg))  # a model and optimizer of its own per way, same initial weights
        tasks[-1].model.to(world.device)
        steps[way] = make(world, tasks[-1], cfg)
    per = _interleaved(steps, batches(world, tasks[0], cfg, 50), rounds, block)
    ratios = [a / b for a, b in zip(per["hvdtrain"], per["horovod"], strict=True)]
    return {"kind": "step-overhead", "task": task_name, "np": world.size, "rounds": rounds, "block": block,
            "hvdtrain_step_s": statistics.median(per["hvdtrain"]),
            "horovod_step_s": statistics.median(per["horovod"]),
            "ratio_median": statistics.median(ratios),
            "ratio_q1_q3": statistics.quantiles(ratios, n=4)[::2]}


def _tiny_loss(model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    x, y = batch
    return nn.functional.mse_loss(model(x), y), {}


def _tiny_step(world: World, way: str) -> Any:
    from hvdtrain.step import train_step

    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    if way == "torch":
        return plain_step(model, optimizer, _tiny_loss)
    if way == "horovod":
        return plain_step(model, horovod_optimizer(optimizer, model), _tiny_loss)
    reducer, sums = GradReducer(world, model.named_parameters()), MetricSums()
    return lambda batch: train_step(model, optimizer, reducer, [batch], _tiny_loss, sums, 0.0, world.device)


def measure_fixed(world: World, rounds: int, block: int) -> dict[str, Any]:
    """Microseconds per step of each way on a model too small to matter (medians over rounds)."""
    steps = {way: _tiny_step(world, way) for way in ("hvdtrain", "horovod", "torch")}
    per = _interleaved(steps, [(torch.randn(4, 8), torch.randn(4, 8))], rounds, block * 10)
    us = {way: statistics.median(v) * 1e6 for way, v in per.items()}
    return {"kind": "step-fixed-cost", "np": world.size, "rounds": rounds, "steps_per_block": block * 10,
            **{f"{way}_us": round(v, 1) for way, v in us.items()},
            "hvdtrain_minus_horovod_us": round(us["hvdtrain"] - us["horovod"], 1)}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tasks", default="digits,pylm")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--block", type=int, default=20)
    args = p.parse_args()
    world, _, controller = hvdtrain_world()  # World.init with the toolkit's defaults, one thread
    for name in args.tasks.split(","):
        record = measure_fixed(world, args.rounds, args.block) if name == "fixed" else \
            measure(world, name, args.rounds, args.block)  # build_task seeds: same weights per way
        if world.is_root:
            print(json.dumps({**record, "controller": controller}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
