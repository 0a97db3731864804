"""Graceful stop on signals: the way a preempted or time-limited cluster job ends well.

Slurm sends SIGTERM before killing a job at its time limit or on preemption, or the signal asked for
with `#SBATCH --signal=[B:]USR1@90`; Kubernetes sends SIGTERM before deleting a pod. With a stop
signal (`train.stop_signals`) on any rank, every rank stops at the same step boundary: the request
travels in the step's flags (hvdtrain/step.py, fused with the gradient allreduce), the loop writes a
checkpoint, and the process exits with EXIT_STOPPED, which a requeue script tests before
`scontrol requeue` (examples/slurm.sbatch); `--resume auto` then continues exactly. A second stop
signal, or `train.stop_grace` seconds after the first, exits at once with the same code: the last
checkpoint written is the one to resume from.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from types import FrameType
from typing import Any

from hvdtrain.config_features import parse_signals

EXIT_STOPPED = 99  # stopped on a signal; resume with --resume auto (not a failure: requeue)


class StopSignals:
    """Installs handlers for the stop signals while a run is in progress (`close` restores the
    previous ones). `requested` turns True on the first signal; the loop reads it through the
    step flags, so all ranks act on it at the same step."""

    def __init__(self, names: str, grace: float, rank: int) -> None:
        self.grace, self.rank = grace, rank
        self.signal: str | None = None  # the first one received
        self._when = 0.0
        self._previous: dict[int, Any] = {}
        self._deadline: threading.Timer | None = None
        if threading.current_thread() is not threading.main_thread():
            return  # Python sets handlers in the main thread only: a run in another thread keeps none
        for name in parse_signals(names):
            num = getattr(signal, name)
            self._previous[num] = signal.signal(num, self._on_signal)

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def _on_signal(self, num: int, frame: FrameType | None) -> None:
        name = signal.Signals(num).name
        if self.signal is not None:
            self._exit(f"a second stop signal ({name}) {time.monotonic() - self._when:.0f} s after {self.signal}")
        self.signal, self._when = name, time.monotonic()
        print(f"hvdtrain: rank {self.rank}: {name}: stopping at the next step boundary, after a checkpoint "
              f"(a second signal, or {self.grace:g} s from now, stops at once)", file=sys.stderr, flush=True)
        if self.grace > 0:
            self._deadline = threading.Timer(self.grace, self._exit, (f"train.stop_grace={self.grace:g} s passed",))
            self._deadline.daemon = True
            self._deadline.start()

    def _exit(self, why: str) -> None:
        print(f"hvdtrain: rank {self.rank}: {why}: exiting now (code {EXIT_STOPPED}); resume from the last "
              "checkpoint", file=sys.stderr, flush=True)
        os._exit(EXIT_STOPPED)

    def close(self) -> None:
        """Restore the previous handlers and cancel the deadline (the run ended or stopped)."""
        if self._deadline is not None:
            self._deadline.cancel()
        for num, handler in self._previous.items():
            signal.signal(num, handler)
        self._previous = {}
