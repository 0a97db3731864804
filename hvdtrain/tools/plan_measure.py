"""Measured side of `hvdtrain plan --measure`: a few real steps of a built-in task at one ZeRO stage.

On CPU there are no allocator statistics, so the figures are exact tensor bytes each rank holds
(parameters, gradients, optimizer state) right after the last step's update, before gradients are
released, plus the process's peak RSS (VmHWM, reset through /proc/self/clear_refs before the steps).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

import torch

from hvdtrain.common import num_samples
from hvdtrain.profile.memory import proc_status, reset_peak_rss
from hvdtrain.world import World


def _tensor_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _unsharded_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    params = list(model.parameters())  # tied weights once
    return {"params": _tensor_bytes(params), "grads": _tensor_bytes(p.grad for p in params),
            "optimizer": _tensor_bytes(v for st in optimizer.state.values() for v in st.values())}


def measure(world: World, cfg: Any, stage: int, optimizer_name: str, steps: int) -> dict[str, Any]:
    """Run `steps` optimizer steps; bytes per category on the largest rank, peak RSS. All ranks call."""
    from hvdtrain.comm.build import make_reducer
    from hvdtrain.comm.zero import ZeroReducer
    from hvdtrain.common import to_device
    from hvdtrain.data import ShardedBatchSampler, train_loader
    from hvdtrain.optim import build_optimizer
    from hvdtrain.tasks import build_task

    cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, name=optimizer_name))
    task = build_task(cfg)
    model = task.model.to(world.device)
    sampler = ShardedBatchSampler(num_samples(task.train_set), world, cfg.train.batch_size, 1, cfg.seed)
    batches = [b for b, _ in zip(train_loader(task.train_set, sampler), range(max(1, steps)))]
    rss_built = proc_status()["VmRSS"]  # the model and data are built; no gradient or state yet
    reset_peak_rss()
    cfg = dataclasses.replace(cfg, memory=dataclasses.replace(cfg.memory, zero_stage=stage))
    reducer = make_reducer(world, model, cfg)
    optimizer, _ = reducer.prepare_optimizer(build_optimizer(model, cfg.optim), 0.0)
    times = []
    for i, batch in enumerate(batches):
        start = time.perf_counter()
        loss, _ = task.loss_fn(model, to_device(batch, world.device))
        loss.backward()
        if reducer.synchronize():
            optimizer.step()
        times.append(time.perf_counter() - start)
        if i == len(batches) - 1:  # gradients and updated state both alive: the steady-state high mark
            held = reducer.memory() if isinstance(reducer, ZeroReducer) else _unsharded_bytes(model, optimizer)
        optimizer.zero_grad()
    reducer.remove()
    numels = [b["numel"] for b in reducer.buckets] if stage else [sum(p.numel() for p in b) for b in reducer.buckets]
    comm = _comm_seconds(world, numels, stage)
    held["total"] = sum(held.values())
    held["peak_rss"] = proc_status()["VmHWM"]
    held["rss_after_model_build"] = rss_built
    held["step_s"] = statistics.median(times)  # type: ignore[assignment]  # seconds among byte counts
    every = world.allgather_object(held, name="hvdtrain.plan.measured")
    out = {k: max(r[k] for r in every) for k in held}
    out["per_rank_total"] = [r["total"] for r in every]
    out["comm_s"] = {k: max(c[k] for c in world.allgather_object(comm, name="hvdtrain.plan.comm")) for k in comm}
    return out


def _comm_seconds(world: World, numels: list[int], stage: int, repeats: int = 3) -> dict[str, float]:
    """Median seconds of the step's collectives over the real bucket sizes, one bucket after the
    other, without compute to overlap (what the ring model predicts); stage 3 gathers each bucket
    twice, so its allgather figure is twice one round's. All ranks call."""
    kinds = ["reducescatter" if stage >= 2 else "allreduce"] + (["allgather"] if stage else [])
    out: dict[str, float] = {}
    for kind in kinds:
        times = []
        for i in range(repeats + 1):  # the first round warms up Horovod's buffers
            bufs = [torch.randn(n // world.size if kind == "allgather" else n) for n in numels]
            world.barrier()
            start = time.perf_counter()
            for b, x in enumerate(bufs):
                name = f"hvdtrain.plan.{kind}.{b}"
                if kind == "allgather":
                    world.allgather(x, name=name)
                elif kind == "reducescatter":
                    world.reducescatter(x, name=name, op="average")
                else:
                    world.allreduce(x, name=name, op="average")
            if i:
                times.append(time.perf_counter() - start)
        out[kind] = statistics.median(times) * (2 if kind == "allgather" and stage == 3 else 1)
    out["total"] = sum(out.values())
    return out
