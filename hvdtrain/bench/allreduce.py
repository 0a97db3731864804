"""Benchmarks, run under horovodrun; rank 0 prints one JSON line per result.

Every rank times its own operations; a result is the slowest rank's median (a collective is as
fast as its slowest member), with the spread across repeats. Clocks are read after the operation
has completed on this rank (synchronize), never around an asynchronous launch.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from hvdtrain.comm.compression import make_codec
from hvdtrain.common import num_samples
from hvdtrain.world import World

MODES = ("fp32", "fp16", "bf16", "hvd-fp16", "fp32-direct")  # fp32-direct: comm.transport=mpi|gloo (as the controller)
_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30}


def parse_size(text: str) -> int:
    """'64M' -> 67108864 bytes; plain numbers are bytes."""
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text and text[-1] in _UNITS:
        return int(float(text[:-1]) * _UNITS[text[-1]])
    return int(text)


def default_sizes() -> list[int]:
    """1 KiB to 256 MiB in steps of 4x."""
    return [2**10 * 4**i for i in range(10)]


def emit(world: World, record: dict[str, Any]) -> None:
    world.print(json.dumps(record))


def _slowest(world: World, times: list[float], name: str) -> tuple[float, float, float]:
    """(median, min, max) of the rank with the largest median."""
    med = statistics.median(times)
    every = world.allgather_object((med, min(times), max(times)), name=name)
    return max(every)


def _reducer(world: World, mode: str) -> Callable[[torch.Tensor, str], None]:
    """One reduction in `mode`; the codec is made once per mode, as the gradient reducer does."""
    if mode == "hvd-fp16":  # Horovod's own Compression.fp16 with Average: the unsafe baseline
        from hvdtrain.bench.baseline import horovod_fp16_allreduce

        return horovod_fp16_allreduce
    direct: Any = None
    if mode == "fp32-direct":  # the controller's own direct path: comm.transport=mpi under MPI, gloo under Gloo
        if world.controller == "mpi":
            from hvdtrain.comm.mpi import MpiPath

            direct = MpiPath(world.rank)  # every rank makes it, at the same point
        else:
            from hvdtrain.comm.gloo import GlooPath

            direct = GlooPath(world)
    codec = make_codec({"fp32": "none", "fp32-direct": "none"}.get(mode, mode), world, direct)

    def reduce(x: torch.Tensor, name: str) -> None:
        pending = codec.launch(x, name)
        codec.advance(pending)
        codec.finish(pending)
    return reduce


def _iterations(nbytes: int, requested: int) -> int:
    if requested:
        return requested
    return max(3, min(50, int(2**28 // max(nbytes, 1))))  # ~256 MB of traffic per size, 3..50 repeats


def allreduce(world: World, sizes: list[int], modes: list[str], iters: int = 0, warmup: int = 2,
              quiet: bool = False) -> list[dict]:
    """Time a gradient-style allreduce of each size (bytes of fp32 data) in each mode. All ranks call."""
    results = []
    bus = 2 * (world.size - 1) / world.size if world.size > 1 else 1.0
    for nbytes in sizes:
        x = torch.randn(max(1, nbytes // 4), device=world.device)
        base = None
        work = torch.empty_like(x)
        for mode in modes:
            times, reduce = [], _reducer(world, mode)
            for i in range(warmup + _iterations(nbytes, iters)):
                # Codecs overwrite their input: refill it before the clock starts. The reducer hands
                # a codec a freshly concatenated bucket, so this copy is not part of a reduction.
                work.copy_(x)
                world.barrier()
                start = time.perf_counter()
                reduce(work, f"bench.{mode}.{nbytes}")
                if i >= warmup:
                    times.append(time.perf_counter() - start)
            med, lo, hi = _slowest(world, times, f"bench.times.{mode}.{nbytes}")
            wire = x.numel() * (4 if mode == "fp32" else 2)
            base = med if mode == "fp32" else base
            record = {"bench": "allreduce", "np": world.size, "mode": mode, "bytes": x.numel() * 4,
                      "wire_bytes": wire, "time_s": med, "time_min_s": lo, "time_max_s": hi,
                      "algbw_gbit_s": wire * 8 / med / 1e9, "busbw_gbit_s": wire * 8 / med / 1e9 * bus,
                      "speedup_vs_fp32": (base / med) if base else None, "repeats": len(times)}
            if not quiet:
                emit(world, record)
            results.append(record)
    return results


def _time_steps(world: World, task: Any, cfg: Any, batches: list, mode: str | None, warmup: int) -> list[float]:
    """Per-step seconds of real training steps; mode None = no communication at all (compute only)."""
    from hvdtrain.comm.reducer import GradReducer
    from hvdtrain.common import to_device
    from hvdtrain.optim import build_optimizer

    model = task.model
    optimizer = build_optimizer(model, cfg.optim)
    reducer = GradReducer(world, model.named_parameters(), mode or "none", cfg.comm.bucket_mb) if mode else None
    times = []
    for i, batch in enumerate(batches):
        world.barrier()  # start every step together so one rank's lag does not hide in the next
        start = time.perf_counter()
        loss, _ = task.loss_fn(model, to_device(batch, world.device))
        loss.backward()
        if reducer is None or reducer.synchronize():
            optimizer.step()
        optimizer.zero_grad()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    if reducer is not None:
        reducer.remove()
    return times


def compression(world: World, cfg: Any, steps: int, modes: list[str], warmup: int = 3) -> list[dict]:
    """Training step time per codec on one built-in task, same weights and data. All ranks call."""
    import copy

    from hvdtrain.data import ShardedBatchSampler, train_loader
    from hvdtrain.tasks import build_task
    from hvdtrain.tasks.models import count_parameters

    task = build_task(cfg)
    sampler = ShardedBatchSampler(num_samples(task.train_set), world, cfg.train.batch_size, 1, cfg.seed)
    batches = [b for b, _ in zip(train_loader(task.train_set, sampler), range(warmup + steps))]
    initial = copy.deepcopy(task.model.state_dict())
    numel = count_parameters(task.model)
    results, medians = [], {}
    for mode in [None, *modes]:
        task.model.load_state_dict(initial)
        times = _time_steps(world, task, cfg, batches, None if mode is None else mode, warmup)
        med, lo, hi = _slowest(world, times, f"bench.step.{mode}")
        medians[mode or "compute"] = med
        record = {"bench": "compression", "task": cfg.task, "np": world.size, "params": numel,
                  "mode": mode or "compute-only", "step_s": med, "step_min_s": lo, "step_max_s": hi,
                  "samples_per_s": world.size * cfg.train.batch_size / med, "repeats": len(times)}
        if mode and mode != "none" and "none" in medians:
            record["speedup_vs_none"] = medians["none"] / med
        emit(world, record)
        results.append(record)
    if "none" in medians and "fp16" in medians:
        results.append(_bound(world, numel, medians))
    return results


def _bound(world: World, numel: int, medians: dict[str, float]) -> dict:
    """What fp16 can at best save: (compute + comm32) / (compute + comm16), comm timed alone."""
    comm = {r["mode"]: r["time_s"] for r in allreduce(world, [numel * 4], ["fp32", "fp16"], iters=5, quiet=True)}
    bound = (medians["compute"] + comm["fp32"]) / (medians["compute"] + comm["fp16"])
    record = {"bench": "compression-bound", "np": world.size, "compute_s": medians["compute"],
              "comm_fp32_s": comm["fp32"], "comm_fp16_s": comm["fp16"], "bound_speedup": bound,
              "measured_speedup": medians["none"] / medians["fp16"]}
    record["fraction_of_bound"] = (record["measured_speedup"] - 1) / (bound - 1) if bound > 1 else None
    emit(world, record)
    return record
