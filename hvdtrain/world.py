"""The parallel world: made once by `World.init()` and passed to everything that needs rank or size.

This is the one module that imports Horovod. Every collective the toolkit issues, blocking or not,
goes through a method here, and every one carries an explicit name: Horovod matches unnamed
collectives by a per-process counter, so one extra or missing call on a single rank silently pairs
the wrong tensors or deadlocks. Asynchronous methods return a handle that `wait` completes.
"""

from __future__ import annotations

import os
import pickle
import sys
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hvdtrain.allocator import pin_malloc
from hvdtrain.console import whole_lines
from hvdtrain.errors import EnvironmentProblem, PeerLost

OPS = ("sum", "average", "max", "min")


def _horovod() -> Any:
    try:
        import horovod.torch as hvd
    except ImportError as exc:
        missing = isinstance(exc, ModuleNotFoundError) and exc.name == "horovod"
        what = "Horovod is not installed in this environment" if missing else \
            f"Horovod's PyTorch ops are not available ({exc})"
        raise EnvironmentProblem(
            f"{what}; run `hvdtrain build-horovod` (builds Horovod 0.28.1 for this torch and installs it, "
            "2-4 minutes the first time; needs cmake, g++ and Open MPI headers) or ./scripts/install.sh in a checkout"
        ) from None
    return hvd


def lost_peer(exc: BaseException) -> bool:
    """True if `exc` is Horovod shutting down under this rank because another rank died or lost its
    connection (its traceback says nothing the launcher's "first process to exit" line does not)."""
    if isinstance(exc, PeerLost):
        return True
    exceptions = sys.modules.get("horovod.common.exceptions")
    return exceptions is not None and isinstance(exc, exceptions.HorovodInternalError)


def mpi_defaults(env: MutableMapping[str, str]) -> None:
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
    """Rank, size and device of this process; collectives that all ranks must call together.

    A group (`World.group`) is a World too: rank and size within its members, collectives among
    them only (a Horovod process set); `members` lists their ranks in the whole world."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    device: torch.device
    members: tuple[int, ...] = ()  # a group's ranks in the whole world; () for the whole world
    groups: bool = False  # World.init(groups=True): `group` may make process sets
    _process_set: Any = field(default=None, compare=False, repr=False)

    @classmethod
    def init(cls, threads: int | None = None, groups: bool = False) -> World:
        """Initialise Horovod (size 1 without a launcher), pin the local GPU, split CPU threads; on CPU,
        pin glibc's malloc thresholds (`hvdtrain.allocator`; `HVDTRAIN_MALLOC=system` opts out).

        Without `OMP_NUM_THREADS` or `threads`, each rank gets cores / local ranks intra-op threads:
        PyTorch's default (all cores per rank) oversubscribes the node and slows every rank.
        `groups=True` turns on Horovod's dynamic process sets, which `group` needs (pipeline stages
        use them); off by default, as every run would pay for them.
        """
        hvd = _horovod()
        mpi_defaults(os.environ)
        whole_lines()
        hvd.init(process_sets="dynamic" if groups else None)
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
        return cls(hvd.rank(), hvd.size(), local_rank, local_size, device, groups=groups)

    def group(self, ranks: Sequence[int]) -> World:
        """The World of `ranks` (ranks of the whole world, ascending): collectives among them only.
        Every rank of the whole world must call, in the same order, with the same ranks, members or
        not (Horovod registers a process set everywhere); `leave` undoes it. A non-member gets a
        World of size 0 that must not be used for collectives."""
        ranks = tuple(sorted(ranks))
        if self.members:
            raise ValueError("group() is called on the whole world, not on a group")
        mine = ranks.index(self.rank) if self.rank in ranks else -1
        if len(ranks) == self.size:  # the global process set itself (Horovod refuses a duplicate)
            return self
        if not self.groups:
            raise ValueError("groups of ranks need Horovod's dynamic process sets: call World.init(groups=True)")
        pset = _horovod().add_process_set(list(ranks))
        return World(mine, len(ranks) if mine >= 0 else 0, self.local_rank, self.local_size, self.device, ranks,
                     _process_set=pset)

    def leave(self) -> None:
        """Remove this group's process set. Every rank of the whole world calls, for every group it
        made, in the same order."""
        if self._process_set is not None:
            _horovod().remove_process_set(self._process_set)

    def _set(self) -> Any:
        return _horovod().global_process_set if self._process_set is None else self._process_set

    def _root(self, root: int) -> int:
        return self.members[root] if self.members else root

    @staticmethod
    def shutdown() -> None:
        """Shut Horovod down (it may be initialised again afterwards, under Gloo)."""
        _horovod().shutdown()

    @staticmethod
    def horovod_build() -> dict[str, bool]:
        """Which controllers and GPU operations this Horovod was built with."""
        hvd = _horovod()
        return {"nccl": bool(hvd.nccl_built()), "gloo": bool(hvd.gloo_built()), "mpi": bool(hvd.mpi_built())}

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    @property
    def controller(self) -> str:
        """'gloo' or 'mpi': which of Horovod's controllers this world runs on."""
        return "gloo" if _horovod().gloo_enabled() else "mpi"

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
        return _horovod().allreduce(tensor, name=name, op=_op(op), process_set=self._set())

    def allreduce_async(self, tensor: torch.Tensor, name: str, op: str = "sum") -> Any:
        """Start a reduction (never compressed); `wait(handle)` returns the result. Horovod negotiates
        it in the same cycle as the collectives already in flight, and fuses it into their operation
        when dtype and op match (else it is a round of its own). All ranks must call."""
        return _horovod().allreduce_async(tensor, name=name, op=_op(op), process_set=self._set())

    def allreduce_async_(self, tensor: torch.Tensor, name: str, op: str = "average") -> Any:
        """Start a reduction that writes the result into `tensor` itself (no output allocation: a
        fresh 64 MiB tensor costs ~150 ms of page faults on CPU). All ranks must call."""
        return _horovod().allreduce_async_(tensor, name=name, op=_op(op), process_set=self._set())

    def reducescatter(self, tensor: torch.Tensor, name: str, op: str = "average") -> torch.Tensor:
        """This rank's slice (along dim 0) of the reduction. All ranks must call."""
        return _horovod().reducescatter(tensor, name=name, op=_op(op), process_set=self._set())

    def reducescatter_async(self, tensor: torch.Tensor, name: str, op: str = "average") -> Any:
        """Start `reducescatter`; `wait(handle)` returns this rank's slice. All ranks must call."""
        return _horovod().reducescatter_async(tensor, name=name, op=_op(op), process_set=self._set())

    def allgather(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """Every rank's tensor concatenated along dim 0, in rank order. All ranks must call."""
        return _horovod().allgather(tensor, name=name, process_set=self._set())

    def allgather_async(self, tensor: torch.Tensor, name: str) -> Any:
        """Start `allgather`; `wait(handle)` returns the concatenation. All ranks must call."""
        return _horovod().allgather_async(tensor, name=name, process_set=self._set())

    def alltoall_async(self, tensor: torch.Tensor, name: str) -> Any:
        """Start an alltoall of equal chunks along dim 0 (chunk j goes to rank j); `wait(handle)`
        returns (received, splits). All ranks must call."""
        return _horovod().alltoall_async(tensor, name=name, process_set=self._set())

    def wait(self, handle: Any) -> Any:
        """Complete an asynchronous collective and return its result."""
        return _horovod().synchronize(handle)

    def done(self, handle: Any) -> bool:
        """True once an asynchronous collective has completed (`wait` then returns at once)."""
        return bool(_horovod().poll(handle))

    def broadcast(self, tensor: torch.Tensor, name: str, root: int = 0) -> torch.Tensor:
        """Rank `root`'s tensor on every rank (one collective; broadcast_object takes two and a
        pickle). All ranks must call with the same shape and dtype."""
        return _horovod().broadcast(tensor, root_rank=self._root(root), name=name, process_set=self._set())

    def broadcast_async(self, tensor: torch.Tensor, name: str, root: int = 0) -> Any:
        """Start `broadcast`; `wait(handle)` returns rank `root`'s tensor. All ranks must call, and
        wait before starting another of the same name."""
        return _horovod().broadcast_async(tensor, root_rank=self._root(root), name=name,
                                          process_set=self._set())

    def broadcast_object(self, obj: Any, name: str, root: int = 0) -> Any:
        """Rank `root`'s object on every rank. All ranks must call."""
        return _horovod().broadcast_object(obj, root_rank=self._root(root), name=name, process_set=self._set())

    def allgather_object(self, obj: Any, name: str) -> list[Any]:
        """Every rank's object, in rank order, on every rank. All ranks must call."""
        if self._process_set is None:
            return _horovod().allgather_object(obj, name=name)
        # Horovod 0.28.1's allgather_object takes no process set: the same pickle, sizes first.
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = self.allgather(torch.tensor([data.numel()]), name=f"{name}.sizes").tolist()
        blobs = self.allgather(data, name=name).split(sizes)
        return [pickle.loads(b.numpy().tobytes()) for b in blobs]

    def gather_object(self, obj: Any, name: str, root: int = 0) -> list[Any] | None:
        """Every rank's object, in rank order, on rank `root` only (None on the others): one alltoall
        in which each rank sends its pickle to `root` alone, so no rank but `root` ever holds the
        others' objects (allgather_object copies them all to every rank). All ranks must call."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        splits = torch.zeros(self.size, dtype=torch.int32)
        splits[root] = data.numel()
        received, sizes = _horovod().alltoall(data, splits=splits, name=name, process_set=self._set())
        if self.rank != root:
            return None
        return [pickle.loads(b.numpy().tobytes()) for b in received.split(sizes.tolist())]

    def broadcast_parameters(self, params: Mapping[str, torch.Tensor], root: int = 0) -> None:
        """Overwrite tensors in place with rank `root`'s values. All ranks must call."""
        if self._process_set is None:
            _horovod().broadcast_parameters(params, root_rank=root)
            return
        hvd = _horovod()
        handles = [hvd.broadcast_async_(t, root_rank=self._root(root), name=f"hvdtrain.bcast.{name}",
                                        process_set=self._process_set) for name, t in sorted(params.items())]
        for handle in handles:
            hvd.synchronize(handle)

    def barrier(self) -> None:
        """Wait until every rank arrives. All ranks must call."""
        self.allreduce(torch.zeros(1), name="hvdtrain.barrier")


def _op(op: str) -> Any:
    if op not in OPS:
        raise ValueError(f"op={op!r}; choose one of {OPS}")
    hvd = _horovod()
    return {"sum": hvd.Sum, "average": hvd.Average, "max": hvd.Max, "min": hvd.Min}[op]


# Horovod's elastic runtime (horovodrun --min-np/--max-np), for hvdtrain/elastic.py.

def elastic_state_base() -> type:
    """Horovod's elastic State class: `run_elastic` drives objects derived from it (commit, restore,
    sync, host updates)."""
    from horovod.common.elastic import State

    return State


def live_rank() -> int:
    """This process's rank in the current world (it changes when an elastic world re-forms)."""
    return int(_horovod().rank())


def run_elastic(train: Callable[[Any], Any], state: Any) -> Any:
    """Run `train(state)` under Horovod's elastic driver: on a failed collective or a host change,
    restore or sync `state`, re-form the world and call `train` again."""
    return _horovod().elastic.run(train)(state)
