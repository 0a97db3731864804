"""A per-rank watchdog: if this rank makes no progress for `timeout` seconds it says where it is and
ends the process, so a dead, hung or diverged rank stops the whole job instead of hanging it forever.

Horovod's stall inspector only warns by default. Here every rank beats at each phase of a step
("forward/backward", "gradient allreduce", ...). A rank waiting in a collective is usually the
victim, not the cause, so it gets a grace period (half the timeout) on top: the rank stuck outside
a collective (a hang in user code, a dead data loader) reports itself first and its exit makes
horovodrun (Gloo) or mpirun (MPI) terminate the others. If every rank waits in a collective (ranks
diverged into different collectives), each reports the one it waits in after the grace period.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time

EXIT_STALLED = 75


class Watchdog:
    """Call `beat(phase, step[, collective])` whenever this rank moves on; `stop()` at the end."""

    def __init__(self, rank: int, timeout: float) -> None:
        self.rank, self.timeout = rank, timeout
        self.phase, self.step = "start", 0
        self._last = time.monotonic()
        self._limit = timeout * 1.5  # start-up ends in the first broadcast from rank 0
        self._done = threading.Event()
        self._thread = None
        if timeout > 0:
            self._thread = threading.Thread(target=self._watch, name="hvdtrain-watchdog", daemon=True)
            self._thread.start()

    def beat(self, phase: str, step: int, collective: bool = False) -> None:
        """Progress: entering `phase` (`collective`: waiting on other ranks there)."""
        self.phase, self.step, self._last = phase, step, time.monotonic()
        self._limit = self.timeout * (1.5 if collective else 1.0)

    def stop(self) -> None:
        self._done.set()

    def _watch(self) -> None:
        poll = min(1.0, self.timeout / 4)
        while not self._done.wait(poll):
            idle = time.monotonic() - self._last
            if idle > self._limit:
                print(f"hvdtrain: error: rank {self.rank} on {socket.gethostname()} made no progress for {idle:.0f} s "
                      f"(train.stall_timeout={self.timeout:g} s), stuck in {self.phase} at step {self.step}",
                      file=sys.stderr, flush=True)
                os._exit(EXIT_STALLED)
