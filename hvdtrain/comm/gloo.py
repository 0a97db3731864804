"""torch.distributed's Gloo beside Horovod: the direct gradient path (`comm.transport=gloo`, `Direct`
in hvdtrain/comm/compression.py) reduces fp32 buckets through a Gloo process group of its own, the
data path DDP uses on CPU, instead of through Horovod's background thread.

A Horovod collective over Gloo costs a coordination round among all ranks before its data moves
(one more Gloo allreduce, each message a wake-up of Gloo's I/O thread and of the waiting one); for
buckets that are the same every step that round decides nothing (figures: docs/bench-train.md).

The group is set up once per reducer, beside Horovod's own Gloo context: rank 0 serves a TCPStore on
a free port of the address its peers reach it by, and one Horovod broadcast tells them where.
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any

import torch

from hvdtrain.errors import EnvironmentProblem, PeerLost
from hvdtrain.world import World


def _interface_address(name: str) -> str:
    import psutil  # a Horovod dependency

    for addr in psutil.net_if_addrs().get(name, []):
        if addr.family == socket.AF_INET:
            return str(addr.address)
    raise EnvironmentProblem(f"HOROVOD_GLOO_IFACE={name} has no IPv4 address on {socket.gethostname()}")


class GlooPath:
    """fp32 Sum allreduces on a torch.distributed Gloo process group over the whole world."""

    # Setting up waits at most this long for a peer; a rank that failed is then agreed on by all.
    SETUP = datetime.timedelta(seconds=60)
    # torch's own default, not Horovod's 30 s: Horovod's thread keeps cycling while a peer is busy
    # (a checkpoint, an evaluation), but this allreduce waits for the peer itself. A peer that died
    # breaks the connection at once; one that hangs is the watchdog's (train.stall_timeout).
    TIMEOUT = datetime.timedelta(minutes=30)

    def __init__(self, world: World) -> None:
        from torch.distributed import ProcessGroupGloo as Gloo
        from torch.distributed import TCPStore

        gloo: Any = Gloo  # its options and allreduce are not in torch's type stubs
        # horovodrun names the interface every host shares (Horovod's Gloo uses it); without it the
        # hostname's address, as torchrun's rendezvous would use.
        iface = os.environ.get("HOROVOD_GLOO_IFACE")
        # Every step that can fail on one rank is followed by an agreement (one Horovod collective),
        # so a rank that failed never leaves the others waiting for it in the store or the group.
        master, where, error = None, None, ""
        try:
            here = _interface_address(iface) if iface else socket.gethostbyname(socket.gethostname())
            device = gloo.create_device(interface=iface) if iface else gloo.create_device(hostname=here)
            if world.rank == 0:
                master = TCPStore(here, 0, world.size, is_master=True, wait_for_workers=False, timeout=self.SETUP)
                where = (here, master.port)
        except Exception as exc:  # noqa: BLE001 - agreed below
            error = f"rank {world.rank}: {exc}"
        every = world.allgather_object((where, error), name="hvdtrain.gloo.store")
        self._agree([e for _, e in every], master)
        try:
            host, port = every[0][0]
            self.store = master if master is not None else TCPStore(host, port, world.size, is_master=False,
                                                                    timeout=self.SETUP)
            options = gloo._Options()
            options._timeout = self.SETUP
            options._devices = [device]
            self.group: Any = gloo(self.store, world.rank, world.size, options)
        except Exception as exc:  # noqa: BLE001 - agreed below
            error = f"rank {world.rank}: {exc}"
        self._agree(world.allgather_object(error, name="hvdtrain.gloo.ready"), getattr(self, "group", None))
        self.group.set_timeout(self.TIMEOUT)

    @staticmethod
    def _agree(errors: list[str], made: Any) -> None:
        """Raise on every rank if any rank failed (the first failure named), closing what this rank made."""
        errors = [e for e in errors if e]
        if not errors:
            return
        if made is not None and hasattr(made, "shutdown"):
            made.shutdown()
        raise EnvironmentProblem(f"comm.transport=gloo could not set up its Gloo group ({errors[0]}); "
                                 "use comm.transport=horovod")

    def start(self, tensor: torch.Tensor) -> Any:
        """Start a Sum over ranks in place; every rank must start the same tensors in the same order."""
        return self.group.allreduce([tensor])

    def wait(self, handle: Any) -> None:
        try:
            handle.wait()
        except RuntimeError as exc:  # torch's DistBackendError and DistNetworkError among them
            raise PeerLost(f"the direct Gloo allreduce failed: {exc}") from exc

    def close(self) -> None:
        # Shut down before exit: a group still alive at interpreter teardown races its I/O threads.
        self.group.shutdown()
