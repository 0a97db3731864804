"""The reducer a config asks for: the one place that maps `memory.zero_stage` and `comm` to a
reducer, for the training loop and the tools that step a model the same way (bench memory, plan
--measure)."""

from __future__ import annotations

from typing import Any

from torch import nn

from hvdtrain.comm.reducer import GradReducer, HookedBuckets
from hvdtrain.comm.zero import ZeroReducer
from hvdtrain.comm.zero3 import Zero3Reducer
from hvdtrain.config import Config
from hvdtrain.errors import ConfigError
from hvdtrain.world import World


def make_reducer(world: World, model: nn.Module, cfg: Config, codec: str | None = None) -> HookedBuckets:
    """A reducer over `model`'s trainable parameters for `cfg` (`codec`: the starting gradient codec,
    default `comm.compression`). All ranks must call (ZeRO-3 broadcasts rank 0's weights)."""
    codec = codec or cfg.comm.compression
    comm, mem, clip = cfg.comm, cfg.memory, cfg.optim.clip_grad_norm
    if mem.zero_stage == 3:
        return Zero3Reducer(world, model, mem.zero3_units, codec, clip=clip, prefetch=mem.zero3_prefetch)
    if mem.zero_stage:
        return ZeroReducer(world, model.named_parameters(), mem.zero_stage, codec, comm.bucket_mb,
                           comm.error_feedback, clip)
    return GradReducer(world, model.named_parameters(), codec, comm.bucket_mb, comm.error_feedback,
                       _direct(world, model, comm.transport))


def _direct(world: World, model: nn.Module, transport: str) -> Any:
    """comm.transport=mpi|gloo: the path for the direct fp32 buckets; None for Horovod's. The checks
    give every rank the same answer (controller and device are alike across ranks)."""
    if transport == "horovod" or world.size == 1:
        return None
    if world.members or (transport == "mpi" and world.controller != "mpi"):
        need = "Horovod's MPI controller over" if transport == "mpi" else "a Horovod job over"
        raise ConfigError(f"comm.transport={transport} needs {need} the whole world (horovodrun "
                          f"{'--mpi ' if transport == 'mpi' else ''}or hvdtrain launch); use comm.transport=horovod")
    if any(p.device.type != "cpu" for p in model.parameters()):
        raise ConfigError(f"comm.transport={transport} reduces CPU tensors only; use comm.transport=horovod on GPUs")
    if transport == "gloo":
        from hvdtrain.comm.gloo import GlooPath

        return GlooPath(world)
    from hvdtrain.comm.mpi import MpiPath

    return MpiPath(world.rank)
