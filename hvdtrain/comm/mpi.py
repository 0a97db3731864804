"""MPI beside Horovod, through mpi4py: pipeline stages' messages (hvdtrain/parallel/p2p.py) and the
direct gradient path (`Direct` in hvdtrain/comm/compression.py) use it; everything else goes through Horovod.

Horovod's MPI controller initialises MPI with MPI_THREAD_MULTIPLE and runs its collectives on its
own duplicate of MPI_COMM_WORLD from its background thread; ours run on another duplicate from the
training thread, so neither can match the other's messages. Under Gloo there is no MPI to share.
"""

from __future__ import annotations

from typing import Any

import torch

from hvdtrain.errors import EnvironmentProblem


def mpi_comm(rank: int) -> Any:
    """A duplicate of MPI_COMM_WORLD; `rank` is this process's Horovod rank, which must be its MPI
    rank. Call after Horovod's MPI is up; every rank must call (duplicating is collective)."""
    try:
        from mpi4py import MPI
    except ImportError:
        raise EnvironmentProblem("mpi4py is missing (pip install mpi4py, built against the same MPI as "
                                 "Horovod)") from None
    if MPI.Query_thread() != MPI.THREAD_MULTIPLE:
        raise EnvironmentProblem(f"MPI runs at thread level {MPI.Query_thread()}, not MPI_THREAD_MULTIPLE: Horovod's "
                                 "background thread and the training thread both call MPI")
    if MPI.COMM_WORLD.Get_rank() != rank:
        raise EnvironmentProblem(f"MPI rank {MPI.COMM_WORLD.Get_rank()} is Horovod rank {rank}: Horovod was "
                                 "initialised on another communicator than MPI_COMM_WORLD")
    return MPI.COMM_WORLD.Dup()


class MpiPath:
    """fp32 Sum allreduces on a duplicate of MPI_COMM_WORLD (mpi4py `Iallreduce` in place)."""

    def __init__(self, rank: int) -> None:
        self.comm = mpi_comm(rank)

    def start(self, tensor: torch.Tensor) -> Any:
        """Start a Sum over ranks in place; every rank must start the same tensors in the same order."""
        MPI = mpi()
        request = self.comm.Iallreduce(MPI.IN_PLACE, [tensor.numpy(), MPI.FLOAT], op=MPI.SUM)
        request.Test()  # a first push: Open MPI progresses a nonblocking collective only inside MPI calls
        return request

    def wait(self, handle: Any) -> None:
        handle.Wait()

    def close(self) -> None:
        self.comm.Free()


def mpi() -> Any:
    """The mpi4py MPI module (after `mpi_comm` has checked it is there)."""
    from mpi4py import MPI

    return MPI
