"""Gradient codecs: how one flat fp32 gradient bucket travels through Horovod and comes back averaged.

- `none`: fp32 allreduce (Average).
- `fp16`: divide by the world size in fp32 *before* the cast, Sum in fp16, cast back. Horovod's own
  `Compression.fp16` casts first and lets Average sum in fp16, so 4e4 + 4e4 is already inf at two
  ranks; dividing first keeps every partial sum within the range of the final mean.
- `bf16`: Horovod 0.28.1 has no bfloat16 type, so the bf16 bits travel as int16: an alltoall sends
  chunk j of every rank's bucket to rank j, which sums its n chunks in fp32 (a reduce-scatter) and
  allgathers the bf16 result. Wire bytes equal a bf16 ring allreduce; accumulation stays fp32.

Each codec's `launch` starts the collective(s) asynchronously and returns a `Pending`; `finish`
waits and returns the averaged fp32 bucket. All ranks must launch the same names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hvdtrain.world import World, _import_horovod

CODECS = ("none", "fp16", "bf16")


@dataclass
class Pending:
    handle: Any
    sent: torch.Tensor | None  # this rank's contribution as the wire carries it, in fp32 (None: exact)
    numel: int
    name: str
    stage: int = 0


class Codec:
    """Base: fp32 allreduce with Horovod's Average."""

    name = "none"
    wire_bytes = 4

    def __init__(self, world_size: int) -> None:
        self.n = world_size

    def launch(self, bucket: torch.Tensor, name: str, want_sent: bool = False) -> Pending:
        """Start reducing `bucket` (which the codec may overwrite); `want_sent` also returns this
        rank's contribution as the wire carries it (for error feedback). All ranks must call."""
        hvd = _import_horovod()
        return Pending(hvd.allreduce_async_(bucket, op=hvd.Average, name=name), None, bucket.numel(), name)

    def advance(self, pending: Pending) -> None:
        """Start a second phase, if the codec has one. Call for every bucket before any `finish`."""

    def finish(self, pending: Pending) -> torch.Tensor:
        """Wait; return the averaged bucket in fp32."""
        return _import_horovod().synchronize(pending.handle)


class FP16(Codec):
    """Overflow-safe fp16: pre-divide in fp32, Sum in fp16, widen back."""

    name = "fp16"
    wire_bytes = 2

    def launch(self, bucket: torch.Tensor, name: str, want_sent: bool = False) -> Pending:
        hvd = _import_horovod()
        # The division happens in fp32, so a per-rank value only overflows if it exceeds 65504 * n;
        # each partial sum of the ring is then bounded by the final mean's magnitude.
        half = bucket.div_(self.n).half()
        sent = half.float() * self.n if want_sent else None
        return Pending(hvd.allreduce_async_(half, op=hvd.Sum, name=name), sent, bucket.numel(), name)

    def finish(self, pending: Pending) -> torch.Tensor:
        return _import_horovod().synchronize(pending.handle).float()


class BF16(Codec):
    """bf16 bits through alltoall (as int16), fp32 sums per chunk, allgather of the bf16 result."""

    name = "bf16"
    wire_bytes = 2

    def launch(self, bucket: torch.Tensor, name: str, want_sent: bool = False) -> Pending:
        hvd = _import_horovod()
        numel = bucket.numel()
        padded = -(-numel // self.n) * self.n  # alltoall splits dim 0 evenly: pad to a multiple of n
        x = torch.zeros(padded, dtype=torch.bfloat16, device=bucket.device)
        x[:numel] = bucket
        handle = hvd.alltoall_async(x.view(torch.int16), name=name + ".a2a")
        return Pending(handle, x[:numel].float() if want_sent else None, numel, name)

    def advance(self, pending: Pending) -> None:
        hvd = _import_horovod()
        received, _ = hvd.synchronize(pending.handle)
        chunks = received.view(torch.bfloat16).view(self.n, -1).float()
        mine = (chunks.sum(dim=0) / self.n).to(torch.bfloat16)
        pending.handle = hvd.allgather_async(mine.view(torch.int16), name=pending.name + ".ag")
        pending.stage = 1

    def finish(self, pending: Pending) -> torch.Tensor:
        if pending.stage == 0:
            self.advance(pending)
        gathered = _import_horovod().synchronize(pending.handle)
        return gathered.view(torch.bfloat16)[: pending.numel].float()


def make_codec(name: str, world_size: int) -> Codec:
    return {"none": Codec, "fp16": FP16, "bf16": BF16}[name](world_size)


class AutoSelect:
    """compression=auto: the first steps run with `none`, then with `fp16` (each after a warm-up
    step), and the faster median step time wins. Rank 0's timings decide and are broadcast, so every
    rank switches at the same step. `restart()` re-runs the trial (e.g. after a batch-size change)."""

    CANDIDATES = ("none", "fp16")

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.restart()

    def restart(self) -> None:
        # (codec, timed?) per step: one untimed warm-up step per candidate, then `steps` timed ones.
        self.plan = [(c, i > 0) for c in self.CANDIDATES for i in range(self.steps + 1)]
        self.times: dict[str, list[float]] = {c: [] for c in self.CANDIDATES}
        self.choice: str | None = None
        self.medians: dict[str, float] = {}

    def codec_for_next_step(self) -> str | None:
        """The codec the next step must use, or None when no trial is running."""
        return self.plan[0][0] if self.plan else None

    def record(self, seconds: float) -> bool:
        """Time of the step just run; True when the trial is over and `decide` must be called."""
        codec, timed = self.plan.pop(0)
        if timed:
            self.times[codec].append(seconds)
        return not self.plan

    def decide(self, world: World) -> str:
        """Pick the faster codec from rank 0's timings. All ranks must call."""
        medians = {c: sorted(t)[len(t) // 2] for c, t in self.times.items() if t}
        best = min(medians, key=medians.get) if world.is_root else None
        self.choice = world.broadcast_object(best, name="hvdtrain.auto.choice")
        self.medians = world.broadcast_object(medians, name="hvdtrain.auto.medians")
        return self.choice
