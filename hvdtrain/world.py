"""The parallel world: made once by `World.init()` and passed to everything that needs rank or size.

All collectives the toolkit issues go through the methods here, and every one carries an explicit
name: Horovod matches unnamed collectives by a per-process counter, so one extra or missing call on
a single rank silently pairs the wrong tensors or deadlocks.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

import torch

from hvdtrain.allocator import pin_malloc
from hvdtrain.errors import EnvironmentProblem

_OPS = ("sum", "average", "max", "min")


def _import_horovod() -> Any:
    try:
        import horovod.torch as hvd
    except ImportError as exc:
        raise EnvironmentProblem(
            f"Horovod's PyTorch ops are not available ({exc}); run ./scripts/install.sh, "
            "which builds Horovod 0.28.1 with HOROVOD_WITH_PYTORCH=1"
        ) from None
    return hvd


def _mpi_defaults(env: Any) -> None:
    """Open MPI settings measured faster here, set only where the user has not set them.

    Open MPI busy-polls while it waits, and Horovod's background thread waits in MPI every cycle
    (coordination) and for every collective, so each rank's poller competes with its own and its
    peers' compute threads for the cores. Yielding while idle took pylm at 2 ranks from 51.7 to
    31.2 ms/step (DDP: 36.2 ms) and digits from 5.45 to 5.84 ms (within its spread); see
    docs/bench-train.md. With a core to spare, sched_yield returns at once and costs nothing.
    Read at MPI_Init, so it must be in the environment before hvd.init().
    """
    if "OMPI_COMM_WORLD_RANK" in env:  # launched by Open MPI's mpirun (horovodrun --mpi, hvdtrain launch)
        env.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")


@dataclass(frozen=True)
class World:
    """Rank, size and device of this process; collectives that all ranks must call together."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    device: torch.device

    @classmethod
    def init(cls, threads: int | None = None) -> World:
        """Initialise Horovod (size 1 without a launcher), pin the local GPU, split CPU threads; on CPU,
        pin glibc's malloc thresholds (`hvdtrain.allocator`; `HVDTRAIN_MALLOC=system` opts out).

        Without `OMP_NUM_THREADS` or `threads`, each rank gets cores / local ranks intra-op threads:
        PyTorch's default (all cores per rank) oversubscribes the node and slows every rank.
        """
        hvd = _import_horovod()
        _mpi_defaults(os.environ)
        hvd.init()
        local_rank, local_size = hvd.local_rank(), hvd.local_size()
        if torch.cuda.is_available():
            torch.cuda.set_device(local_rank)
            device = torch.device("cuda", local_rank)
        else:
            device = torch.device("cpu")
            pin_malloc(os.environ)  # CPU steps re-fault their large buffers each step otherwise
        if threads is None and "OMP_NUM_THREADS" not in os.environ:
            threads = max(1, (os.cpu_count() or 1) // local_size)
        if threads:
            torch.set_num_threads(threads)
        return cls(hvd.rank(), hvd.size(), local_rank, local_size, device)

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def print(self, *args: Any, **kwargs: Any) -> None:
        """Print on rank 0 only; other ranks stay quiet."""
        if self.is_root:
            print(*args, **kwargs, flush=True)

    def warn(self, message: str) -> None:
        if self.is_root:
            print(f"hvdtrain: warning: {message}", file=sys.stderr, flush=True)

    # Collectives: every rank must call each of these, in the same order, with the same name.

    def allreduce(self, tensor: torch.Tensor, name: str, op: str = "sum") -> torch.Tensor:
        """Reduce a tensor across ranks (never compressed). All ranks must call."""
        return _import_horovod().allreduce(tensor, name=name, op=_hvd_op(op))

    def allreduce_async(self, tensor: torch.Tensor, name: str, op: str = "sum") -> Any:
        """Start a reduction (never compressed); `wait(handle)` returns the result. Horovod negotiates
        it in the same cycle as the collectives already in flight, and fuses it into their operation
        when dtype and op match (else it is a round of its own). All ranks must call."""
        return _import_horovod().allreduce_async(tensor, name=name, op=_hvd_op(op))

    def wait(self, handle: Any) -> torch.Tensor:
        return _import_horovod().synchronize(handle)

    def broadcast(self, tensor: torch.Tensor, name: str, root: int = 0) -> torch.Tensor:
        """Rank `root`'s tensor on every rank (one collective; broadcast_object takes two and a
        pickle). All ranks must call with the same shape and dtype."""
        return _import_horovod().broadcast(tensor, root_rank=root, name=name)

    def broadcast_async(self, tensor: torch.Tensor, name: str, root: int = 0) -> Any:
        """Start `broadcast`; `wait(handle)` returns rank `root`'s tensor. All ranks must call, and
        wait before starting another of the same name."""
        return _import_horovod().broadcast_async(tensor, root_rank=root, name=name)

    def broadcast_object(self, obj: Any, name: str, root: int = 0) -> Any:
        """Rank `root`'s object on every rank. All ranks must call."""
        return _import_horovod().broadcast_object(obj, root_rank=root, name=name)

    def allgather_object(self, obj: Any, name: str) -> list[Any]:
        """Every rank's object, in rank order, on every rank. All ranks must call."""
        return _import_horovod().allgather_object(obj, name=name)

    def broadcast_parameters(self, params: Any, root: int = 0) -> None:
        """Overwrite tensors in place with rank `root`'s values. All ranks must call."""
        _import_horovod().broadcast_parameters(params, root_rank=root)

    def barrier(self) -> None:
        """Wait until every rank arrives. All ranks must call."""
        self.allreduce(torch.zeros(1), name="hvdtrain.barrier")


def _hvd_op(op: str) -> Any:
    if op not in _OPS:
        raise ValueError(f"op={op!r}; choose one of {_OPS}")
    hvd = _import_horovod()
    return {"sum": hvd.Sum, "average": hvd.Average, "max": hvd.Max, "min": hvd.Min}[op]
