"""The hand-written baselines the benchmarks compare hvdtrain against: Horovod used the way its own
examples use it (plain `hvd.init()`, `hvd.DistributedOptimizer`, `hvd.Compression.fp16`). This is
the one module besides hvdtrain/world.py that imports Horovod: it must be raw Horovod, not hvdtrain's
door to it, or it would not be a baseline.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import horovod.torch as hvd
import torch

from hvdtrain.world import World


def horovod_world() -> tuple[World, Callable[[Any], list[Any]], str]:
    """Horovod started exactly as a user would (plain hvd.init()); a gather for the results, and the
    controller's name."""
    hvd.init()
    device = torch.device("cuda", hvd.local_rank()) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    world = World(hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), device)
    return world, lambda obj: world.allgather_object(obj, name="bench.loops.gather"), world.controller


def plain_step(model: Any, optimizer: Any, loss_fn: Any) -> Callable[[Any], torch.Tensor]:
    """The loop a user writes by hand: Horovod's optimizer or DDP's hooks do the averaging inside."""
    def step(batch: Any) -> torch.Tensor:
        optimizer.zero_grad()
        loss, _ = loss_fn(model, batch)
        loss.backward()
        optimizer.step()
        return loss.detach()
    return step


def horovod_step(world: World, task: Any, cfg: Any) -> Callable[[Any], torch.Tensor]:
    from hvdtrain.optim import build_optimizer

    model = task.model
    # Horovod: start from rank 0's weights, then average gradients with DistributedOptimizer.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(build_optimizer(model, cfg.optim), named_parameters=model.named_parameters())
    return plain_step(model, optimizer, task.loss_fn)


def horovod_optimizer(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> Any:
    """`hvd.DistributedOptimizer` over `model`'s parameters."""
    return hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())


def horovod_fp16_allreduce(x: torch.Tensor, name: str) -> None:
    """Horovod's own Compression.fp16 with Average: casts first, sums in fp16 (the unsafe baseline
    the fp16 codec is compared with)."""
    c, ctx = hvd.Compression.fp16.compress(x)
    hvd.Compression.fp16.decompress(hvd.allreduce(c, op=hvd.Average, name=name), ctx)
