"""One timed training run in one of three ways, for `hvdtrain bench train` (which launches it).

- `hvdtrain`: the toolkit's own step (`hvdtrain.step.train_step` with the GradReducer), under horovodrun;
- `horovod`: the minimal hand-written loop with `hvd.DistributedOptimizer`, under horovodrun
  (hvdtrain/bench/baseline.py, the one module besides hvdtrain/world.py that imports Horovod);
- `ddp`: PyTorch DistributedDataParallel over torch.distributed (gloo on CPU, nccl on GPU), under torchrun.

Every way trains the same model from the same weights on the same pre-loaded batches with one
intra-op thread per rank. Each rank times every step; rank 0 prints one JSON line with the slowest
rank's median (a data-parallel step is as fast as its slowest rank). Run as
`python -m hvdtrain.bench.loops --mode M --task T [--set k=v ...]` under the matching launcher.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from hvdtrain.common import num_samples

MODES = ("hvdtrain", "horovod", "ddp")


def ddp_world() -> tuple[Any, Callable[[Any], list[Any]], str]:
    import torch.distributed as dist

    from hvdtrain.world import World

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    world = World(dist.get_rank(), dist.get_world_size(), local_rank,
                  int(os.environ.get("LOCAL_WORLD_SIZE", 1)), device)

    def gather(obj: Any) -> list[Any]:
        out: list[Any] = [None] * world.size
        dist.all_gather_object(out, obj)
        return out
    return world, gather, backend


def close_ddp() -> None:
    import torch.distributed as dist

    # Exiting with a live Gloo group races its I/O threads against interpreter teardown ("terminate
    # called without an active exception", SIGABRT on some runs); close it on every rank first.
    dist.barrier()
    dist.destroy_process_group()


def hvdtrain_world() -> tuple[Any, Callable[[Any], list[Any]], str]:
    """World.init with the toolkit's defaults and one thread, a gather, and the controller's name."""
    from hvdtrain.world import World

    world = World.init(threads=1)
    return world, lambda obj: world.allgather_object(obj, name="bench.loops.gather"), world.controller


def hvdtrain_step(world: Any, task: Any, cfg: Any) -> Callable[[Any], torch.Tensor]:
    from hvdtrain.comm.build import make_reducer
    from hvdtrain.metrics import MetricSums
    from hvdtrain.optim import build_optimizer
    from hvdtrain.step import train_step

    model = task.model
    world.broadcast_parameters(model.state_dict())
    optimizer = build_optimizer(model, cfg.optim)
    reducer = make_reducer(world, model, cfg)  # the loop's own choice (comm.transport, comm.compression)
    sums = MetricSums()

    def step(batch: Any) -> torch.Tensor:
        train_step(model, optimizer, reducer, [batch], task.loss_fn, sums, cfg.optim.clip_grad_norm, world.device)
        return sums.sums["loss"]  # the running sum of loss x samples, a tensor (no host sync)
    return step


def ddp_step(world: Any, task: Any, cfg: Any) -> Callable[[Any], torch.Tensor]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hvdtrain.bench.baseline import plain_step
    from hvdtrain.optim import build_optimizer

    # DDP broadcasts rank 0's parameters and buffers when it wraps the model.
    model = DDP(task.model, device_ids=[world.device.index] if world.device.type == "cuda" else None)
    optimizer = build_optimizer(model, cfg.optim)

    return plain_step(model, optimizer, task.loss_fn)


def batches(world: Any, task: Any, cfg: Any, count: int) -> list[Any]:
    from hvdtrain.common import to_device
    from hvdtrain.data import ShardedBatchSampler, train_loader

    sampler = ShardedBatchSampler(num_samples(task.train_set), world, cfg.train.batch_size, 1, cfg.seed)
    out: list[Any] = []
    while len(out) < count:  # wrap around small data sets, identically on every rank
        for b in train_loader(task.train_set, sampler):
            out.append(to_device(b, world.device))
            if len(out) == count:
                break
        sampler.set_epoch(sampler.epoch + 1)
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(mode: str, cfg: Any, steps: int, warmup: int) -> dict[str, Any] | None:
    """Train `warmup + steps` steps in `mode`; the record (on rank 0) or None. All ranks call."""
    from hvdtrain.bench import baseline
    from hvdtrain.tasks import build_task
    from hvdtrain.tasks.models import count_parameters

    torch.set_num_threads(1)
    worlds = {"hvdtrain": hvdtrain_world, "horovod": baseline.horovod_world, "ddp": ddp_world}
    world, gather, backend = worlds[mode]()
    task = build_task(cfg)
    task.model.to(world.device)
    step = {"hvdtrain": hvdtrain_step, "horovod": baseline.horovod_step, "ddp": ddp_step}[mode](world, task, cfg)
    todo = batches(world, task, cfg, warmup + steps)
    times, cpus, faults, losses = [], [], [], []
    for i, batch in enumerate(todo):
        _sync(world.device)
        minflt = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start, cpu = time.perf_counter(), time.process_time()
        loss = step(batch)
        _sync(world.device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
            # CPU of every thread of this rank (Horovod's background thread, Gloo's, DDP's reducer):
            # on shared cores what one way burns besides compute is what it takes from the others.
            cpus.append(time.process_time() - cpu)
            # Pages the kernel faulted in (and zeroed) for this rank during the step: the allocator's churn.
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - minflt)
        losses.append(loss.clone())  # outside the timed window; hvdtrain's running sum is updated in place
    mine = (statistics.median(times), statistics.fmean(times), min(times), max(times), socket.gethostname(),
            statistics.median(cpus), statistics.median(faults))
    every = gather(mine)
    if mode == "ddp":
        close_ddp()
    if world.rank != 0:
        return None
    slowest = max(e[:4] for e in every)
    # hvdtrain keeps a running sum of loss x samples; the others return each step's mean loss.
    last = float(losses[-1] - losses[-2]) / cfg.train.batch_size if mode == "hvdtrain" else float(losses[-1])
    return {"bench": "train-run", "mode": mode, "backend": backend, "task": cfg.task, "np": world.size,
            "params": count_parameters(task.model), "batch_per_rank": cfg.train.batch_size,
            "global_batch": world.size * cfg.train.batch_size, "steps": steps, "warmup": warmup,
            "step_s": slowest[0], "mean_s": slowest[1], "step_min_s": slowest[2], "step_max_s": slowest[3],
            "rank_medians_s": [e[0] for e in every],
            "rank_hosts": [e[4] for e in every], "rank_cpu_s": [e[5] for e in every],
            "rank_minor_faults": [e[6] for e in every],
            "last_loss": last, "threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> int:
    from hvdtrain import config as config_mod

    p = argparse.ArgumentParser(prog="python -m hvdtrain.bench.loops")
    p.add_argument("--mode", choices=MODES, required=True)
    p.add_argument("--task", default="synthetic")
    p.add_argument("--config")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    args = p.parse_args(argv)
    cfg = config_mod.build(args.config, list(args.overrides), task=args.task)
    record = run(args.mode, cfg, args.steps, args.warmup)
    if record is not None:
        print(json.dumps(record), flush=True)
    if args.mode == "ddp":
        # Even after barrier + destroy_process_group, a torchrun worker still aborted in interpreter
        # teardown now and then ("terminate called without an active exception", SIGABRT, 1 of ~40
        # launches on 3 December), failing a finished measurement; skip the teardown.
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
