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

    def __init__(self, world: World) -> None:
        from torch.distributed import ProcessGroupGloo as Gloo
        from torch.distributed import TCPStore

        gloo: Any = Gloo  # its options and allreduce are not in torch's type stubs

        # horovodrun names the interface every host shares (Horovod's Gloo uses it); without it the
        # hostname's address, as torchrun's rendezvous would use.
        iface = os.environ.get("HOROVOD_GLOO_IFACE")
        here = _interface_address(iface) if iface else socket.gethostbyname(socket.gethostname())
        # torch's own default (30 min), not Horovod's 30 s: Horovod's thread keeps cycling while a
        # peer is busy (a checkpoint, an evaluation), but this allreduce waits for the peer itself.
        # A peer that died breaks the connection at once; one that hangs is the watchdog's
        # (train.stall_timeout).
        timeout = datetime.timedelta(minutes=30)
        master = TCPStore(here, 0, world.size, is_master=True, wait_for_workers=False,
                          timeout=timeout) if world.rank == 0 else None
        where = (here, master.port) if master is not None else None
        host, port = world.broadcast_object(where, name="hvdtrain.gloo.store")
        self.store = master if master is not None else TCPStore(host, port, world.size, is_master=False,
                                                                timeout=timeout)
        options = gloo._Options()
        options._timeout = timeout
        options._devices = [gloo.create_device(interface=iface) if iface
                            else gloo.create_device(hostname=here)]
        self.group: Any = gloo(self.store, world.rank, world.size, options)

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
