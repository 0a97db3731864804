"""Activations and their gradients between neighbouring stages: MPI point-to-point through mpi4py,
on a duplicate of MPI_COMM_WORLD beside Horovod's (hvdtrain/comm/mpi.py). Gloo has no
point-to-point, hence MPI only.

Shapes are agreed once: the first message for a micro-batch size carries a small header (dtype
and shape) ahead of its data; both sides know every micro-batch's size (each stage loads the same
batches), so they agree on when a header comes without asking. Data goes as raw bytes from
contiguous CPU tensors (a CUDA tensor is staged through the host: the lent GPU machines have no
CUDA-aware MPI).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from hvdtrain.comm.mpi import mpi

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# A tag is 4 x micro-batch + kind (0: activation, 1: gradient); a header's is 2 + kind. Messages of
# one source and tag arrive in order (MPI's non-overtaking rule), so j wraps around safely.
_WRAP = 4096


class Link:
    """Messages between this rank and the ranks of the stages before and after it."""

    def __init__(self, comm: Any, device: torch.device) -> None:
        self.comm, self.device = comm, device
        # (peer, kind, micro-batch size, phase) -> agreed; phase "train" or "eval" (autocast may differ)
        self._headers: set[tuple[int, int, int, str]] = set()
        self._shapes: dict[tuple[int, int, int, str], tuple[torch.dtype, tuple[int, ...]]] = {}
        self._sends: list[tuple[Any, torch.Tensor]] = []  # requests and the buffers they read
        self.wait_s = 0.0  # seconds spent blocked in receives: the stage's idle time (bench pipeline)

    def send(self, tensor: torch.Tensor, peer: int, kind: int, n: int, j: int, phase: str) -> None:
        """Start sending micro-batch j's (size n) `tensor` to `peer`; `drain` completes it."""
        buf = tensor.detach().to("cpu").contiguous()
        key = (peer, kind, n, phase)
        if key not in self._headers:
            self._headers.add(key)
            header = torch.tensor([DTYPES.index(buf.dtype), *buf.shape], dtype=torch.int64)
            self.comm.Send([header.numpy(), header.numel(), _mpi_int64()], dest=peer, tag=2 + kind)
        # Finished sends let go of their buffers now, not at the end of the step: a stage's input
        # gradients would otherwise pile up, one per micro-batch.
        self._sends = [(r, b) for r, b in self._sends if not r.Test()]
        req = self.comm.Isend([_bytes(buf), _mpi_byte()], dest=peer, tag=_tag(j, kind))
        self._sends.append((req, buf))

    def recv(self, peer: int, kind: int, n: int, j: int, phase: str) -> torch.Tensor:
        """Micro-batch j's (size n) tensor from `peer`, on this rank's device."""
        key = (peer, kind, n, phase)
        if key not in self._shapes:
            status = _status()
            self.comm.Probe(source=peer, tag=2 + kind, status=status)
            header = torch.empty(status.Get_count(_mpi_int64()), dtype=torch.int64)
            self.comm.Recv([header.numpy(), header.numel(), _mpi_int64()], source=peer, tag=2 + kind)
            self._shapes[key] = (DTYPES[int(header[0])], tuple(int(d) for d in header[1:]))
        dtype, shape = self._shapes[key]
        out = torch.empty(shape, dtype=dtype)
        started = time.perf_counter()
        self.comm.Recv([_bytes(out), _mpi_byte()], source=peer, tag=_tag(j, kind))
        self.wait_s += time.perf_counter() - started
        return out.to(self.device, non_blocking=True)

    def drain(self) -> None:
        """Complete every send started so far (their buffers can then go)."""
        for req, _ in self._sends:
            req.Wait()
        self._sends = []

    def free(self) -> None:
        self.drain()
        self.comm.Free()


def _tag(j: int, kind: int) -> int:
    return (j % _WRAP) * 4 + kind


def _bytes(t: torch.Tensor) -> Any:
    return t.view(-1).view(torch.uint8).numpy() if t.numel() else t.view(torch.uint8).numpy()


def _mpi_byte() -> Any:
    return mpi().BYTE


def _mpi_int64() -> Any:
    return mpi().INT64_T


def _status() -> Any:
    return mpi().Status()
