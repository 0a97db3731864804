"""Gradient codecs: how one flat fp32 gradient bucket travels through Horovod and comes back averaged.

- `none`: fp32 allreduce (Average).
- `fp16`: divide by the world size in fp32 *before* the cast, Sum in fp16, cast back. Horovod's own
  `Compression.fp16` casts first and lets Average sum in fp16, so 4e4 + 4e4 is already inf at two
  ranks; dividing first keeps every partial sum within the range of the final mean.
- `bf16`: Horovod 0.28.1 has no bfloat16 type, so the bf16 bits travel as int16: an alltoall sends
  chunk j of every rank's bucket to rank j, which sums its n chunks in fp32 (a reduce-scatter) and
  allgathers the bf16 result. Wire bytes equal a bf16 ring allreduce; accumulation stays fp32.

`reducescatter_launch`/`reducescatter_finish` are the same three codecs as a reduce-scatter for
ZeRO stage 2: each rank gets back only its slice of the averaged bucket.

Each codec's `launch` starts the collective(s) asynchronously and returns a `Pending`; `finish`
waits and returns the averaged fp32 bucket. All ranks must launch the same names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from hvdtrain.metrics import TrainLog
from hvdtrain.world import World

CODECS = ("none", "fp16", "bf16")


@dataclass
class Pending:
    handle: Any
    sent: torch.Tensor | None  # this rank's contribution as the wire carries it, in fp32 (None: exact)
    numel: int
    name: str
    stage: int = 0
    out: torch.Tensor | None = None  # the fp32 bucket the result is written back into (FP16)
    chunks: list = field(default_factory=list)  # FP16: (fp32 view, fp16 view, handle or None) per chunk


class Codec:
    """Base: fp32 allreduce with Horovod's Average."""

    name = "none"
    wire_bytes = 4
    ordered = False  # True: buckets must be launched in index order on every rank (no negotiation)

    def __init__(self, world: World) -> None:
        self.world, self.n = world, world.size

    def launch(self, bucket: torch.Tensor, name: str, want_sent: bool = False) -> Pending:
        """Start reducing `bucket` (which the codec may overwrite); `want_sent` also returns this
        rank's contribution as the wire carries it (for error feedback). All ranks must call."""
        return Pending(self.world.allreduce_async_(bucket, name=name, op="average"), None, bucket.numel(), name)

    def advance(self, pending: Pending) -> None:
        """Start a second phase, if the codec has one. Call for every bucket before any `finish`."""

    def finish(self, pending: Pending) -> torch.Tensor:
        """Wait; return the averaged bucket in fp32."""
        return self.world.wait(pending.handle)


class FP16(Codec):
    """fp16 on the wire: pre-divide in fp32, Sum in fp16, widen back into the bucket.

    Range: any per-rank value whose share (value / ranks) fits fp16, and any average up to 65504 in
    magnitude, travel in fp16 (to fp16's 11-bit precision; below ~6e-5 values lose precision and
    below ~6e-8 they round to 0: error feedback carries that loss to the next step). A chunk whose
    fp16 sum is not finite (the average itself overflowed, or some rank sent inf/NaN) travels again
    in fp32 from the pre-divided values still in the bucket: every rank sees the same sum, so every
    rank decides alike and the step is applied exactly; only a gradient that is not finite in fp32
    either is skipped. The check is one `aminmax` of the received fp16 chunk (2.1 ms per 16M values
    on one CPU core, against the 1.5 s that chunk takes on the 200 Mbit/s testbed link).

    Speed on CPU (2 cores, 64 MiB at 200 Mbit/s) comes from three things, each measured:
    - no fresh allocations: a fresh 64 MiB tensor costs ~150 ms of page faults, more than the casts;
      the fp16 staging buffer is kept per bucket name and the result is widened into the bucket;
    - `div_` in place then `copy_` into fp16 (vectorised, ~20 ms for 16M values) instead of
      `torch.div(..., out=half)` (a slow mixed-dtype path, ~140 ms);
    - optionally (`chunk_bytes` > 0) the bucket travels in chunks with at most `window` in flight,
      so the cast of the next chunk and the widening of the previous one overlap the transfer; with
      only one chunk queued behind the running one Horovod cannot fuse them. Off by default: on the
      testbed 64 MiB in 16 MiB chunks took 1.64-2.0 s against 1.52 s as one collective, because a
      Horovod Gloo collective costs more per operation than the ~40 ms of casts it could hide.
    """

    name = "fp16"
    wire_bytes = 2
    chunk_bytes = 0  # of fp32 data per collective; 0: the whole bucket in one collective
    window = 2

    def __init__(self, world: World) -> None:
        super().__init__(world)
        self._staging: dict[str, torch.Tensor] = {}
        self.fallbacks = 0  # chunks that went again in fp32 because their fp16 sum was not finite

    def _stage(self, name: str, like: torch.Tensor) -> torch.Tensor:
        buf = self._staging.get(name)
        if buf is None or buf.numel() != like.numel() or buf.device != like.device:
            buf = self._staging[name] = torch.empty(like.numel(), dtype=torch.float16, device=like.device)
        return buf

    def launch(self, bucket: torch.Tensor, name: str, want_sent: bool = False) -> Pending:
        half = self._stage(name, bucket)
        step = max(1, self.chunk_bytes // 4 if self.chunk_bytes > 0 else bucket.numel())
        pending = Pending(None, None, bucket.numel(), name, out=bucket)
        if want_sent:
            pending.sent = torch.empty_like(bucket)
        for i in range(0, bucket.numel(), step):
            part32, part16 = bucket[i:i + step], half[i:i + step]
            # The division happens in fp32, so a per-rank value only overflows if it exceeds
            # 65504 * n; each partial sum of the ring is then bounded by the final mean's magnitude.
            part16.copy_(part32.div_(self.n))
            if pending.sent is not None:  # before the collective: the in-place allreduce overwrites it
                pending.sent[i:i + step].copy_(part16).mul_(self.n)
            pending.chunks.append([part32, part16, None, i])
            if len(pending.chunks) <= self.window:
                self._start(pending, len(pending.chunks) - 1)
        return pending

    def _start(self, pending: Pending, i: int) -> None:
        # Same chunking on every rank (same bucket sizes), hence the same names everywhere.
        name = pending.name if i == 0 and pending.numel == pending.chunks[0][0].numel() else f"{pending.name}.c{i}"
        pending.chunks[i][2] = self.world.allreduce_async_(pending.chunks[i][1], name=name, op="sum")

    def finish(self, pending: Pending) -> torch.Tensor:
        for i, (part32, part16, handle, offset) in enumerate(pending.chunks):
            self.world.wait(handle)
            if i + self.window < len(pending.chunks):  # keep the link busy before widening this one
                self._start(pending, i + self.window)
            low, high = torch.aminmax(part16)
            if math.isfinite(float(low)) and math.isfinite(float(high)):
                part32.copy_(part16)
                continue
            # Not finite on every rank alike (they all hold this sum): again in fp32, exactly.
            if pending.sent is not None:
                pending.sent[offset:offset + part32.numel()].copy_(part32).mul_(self.n)
            self.world.wait(self.world.allreduce_async_(part32, name=f"{pending.name}.c{i}.fp32", op="sum"))
            self.fallbacks += 1
        assert pending.out is not None
        return pending.out


class BF16(Codec):
    """bf16 bits through alltoall (as int16), fp32 sums per chunk, allgather of the bf16 result."""

    name = "bf16"
    wire_bytes = 2

    def launch(self, bucket: torch.Tensor, name: str, want_sent: bool = False) -> Pending:
        numel = bucket.numel()
        padded = -(-numel // self.n) * self.n  # alltoall splits dim 0 evenly: pad to a multiple of n
        x = torch.zeros(padded, dtype=torch.bfloat16, device=bucket.device)
        x[:numel] = bucket
        handle = self.world.alltoall_async(x.view(torch.int16), name=name + ".a2a")
        return Pending(handle, x[:numel].float() if want_sent else None, numel, name)

    def advance(self, pending: Pending) -> None:
        received, _ = self.world.wait(pending.handle)
        chunks = received.view(torch.bfloat16).view(self.n, -1).float()
        mine = (chunks.sum(dim=0) / self.n).to(torch.bfloat16)
        pending.handle = self.world.allgather_async(mine.view(torch.int16), name=pending.name + ".ag")
        pending.stage = 1

    def finish(self, pending: Pending) -> torch.Tensor:
        if pending.stage == 0:
            self.advance(pending)
        gathered = self.world.wait(pending.handle)
        return gathered.view(torch.bfloat16)[: pending.numel].float()


class Direct(Codec):
    """`comm.transport=mpi|gloo`: fp32 buckets summed by MPI (mpi4py `Iallreduce`, `MpiPath`) or by a
    torch.distributed Gloo group (`GlooPath`, DDP's data path) in place on the bucket's memory, then
    x 1/N as Horovod's Average does, instead of handed to Horovod.

    A Horovod collective waits for the next cycle of its background thread (1 ms by default) and a
    negotiation round among all ranks before it starts; for a layout that never changes (the same
    buckets in the same order every step) that round decides nothing new. Safe without it because
    every rank launches the buckets in index order (`ordered`: the reducer holds back a bucket that
    backward completed early until those before it have gone), so the collectives pair up. Only
    where the layout is fixed and the path can read the memory: CPU tensors, no ZeRO, adaptive batch,
    elastic world or pipeline (the config and `make_reducer` refuse the rest). Measured (7 December
    2026, 2 ranks, MPI): a 4 KiB allreduce 0.11 ms against Horovod's 1.07 ms; 4 MiB 2.03 ms against
    1.84 ms (Open MPI's nonblocking allreduce is slower for large buffers); see docs/bench-train.md."""

    ordered = True

    def __init__(self, world: World, path: Any) -> None:
        super().__init__(world)
        self.path = path

    def launch(self, bucket: torch.Tensor, name: str, want_sent: bool = False) -> Pending:
        return Pending(self.path.start(bucket), None, bucket.numel(), name, out=bucket)

    def finish(self, pending: Pending) -> torch.Tensor:
        self.path.wait(pending.handle)
        assert pending.out is not None
        return pending.out.mul_(1.0 / self.n)


def make_codec(name: str, world: World, direct: Any = None) -> Codec:
    """Codec `name`; with `direct` (an `MpiPath` or `GlooPath`, comm.transport=mpi|gloo) fp32 buckets
    bypass Horovod (`Direct`); fp16 and bf16 still go through Horovod."""
    if name == "none" and direct is not None:
        return Direct(world, direct)
    return {"none": Codec, "fp16": FP16, "bf16": BF16}[name](world)


def report_fallbacks(reducer: Any, log: TrainLog, step: int) -> None:
    """Log the fp16 chunks that went again in fp32 in step `step` (the same count on every rank: the
    decision is taken on the reduced values); the first time, say so on the console too."""
    n = getattr(reducer.codec, "fallbacks", 0)
    if not n:
        return
    reducer.codec.fallbacks = 0
    log.event(step, "fp16_overflow", chunks=n)
    log.say_once("fp16_overflow", f"hvdtrain: step {step}: the fp16 average overflowed (|mean| > 65504) in "
                 f"{n} chunk(s); they went again in fp32 and the step was applied (later ones: "
                 "fp16_overflow events in metrics.jsonl)")


class FixedCodec:
    """compression=none|fp16|bf16: the reducer keeps the codec it was built with."""

    def __init__(self, name: str) -> None:
        self.initial = name

    def before_step(self, reducer: Any, log: TrainLog, step: int, seconds: float | None) -> None:
        """Nothing to choose (`AutoSelect` times the candidates here); reports fp16 fallbacks."""
        report_fallbacks(reducer, log, step)


class AutoSelect:
    """compression=auto: the first steps run with `none`, then with `fp16` (each after a warm-up
    step), and the faster median step time wins. Rank 0's timings decide and are broadcast, so every
    rank switches at the same step. `restart()` re-runs the trial (e.g. after a batch-size change)."""

    CANDIDATES = ("none", "fp16")
    initial = "none"

    def __init__(self, world: World, steps: int) -> None:
        self.world, self.steps = world, steps
        self.restart()

    def restart(self) -> None:
        # (codec, timed?) per step: one untimed warm-up step per candidate, then `steps` timed ones.
        self.plan = [(c, i > 0) for c in self.CANDIDATES for i in range(self.steps + 1)]
        self.times: dict[str, list[float]] = {c: [] for c in self.CANDIDATES}
        self.choice: str | None = None
        self.medians: dict[str, float] = {}

    def before_step(self, reducer: Any, log: TrainLog, step: int, seconds: float | None) -> None:
        """Set the reducer's codec for the next step, given the last step's `seconds` (None before the
        first); when the trial ends, log which codec won and why. All ranks call at every step."""
        report_fallbacks(reducer, log, step)
        if not self.plan:
            return
        if seconds is not None and self.record(seconds):
            reducer.set_codec(self.decide())
            why = ", ".join(f"{c} {t * 1e3:.1f} ms" for c, t in self.medians.items())
            log.event(step, "compression", choice=self.choice,
                      median_step_ms={c: t * 1e3 for c, t in self.medians.items()})
            log.bar.write(f"hvdtrain: compression=auto chose {self.choice} (median step: {why})")
            return
        reducer.set_codec(self.plan[0][0])

    def codec_for_next_step(self) -> str | None:
        """The codec the next step must use, or None when no trial is running."""
        return self.plan[0][0] if self.plan else None

    def record(self, seconds: float) -> bool:
        """Time of the step just run; True when the trial is over and `decide` must be called."""
        codec, timed = self.plan.pop(0)
        if timed:
            self.times[codec].append(seconds)
        return not self.plan

    def decide(self) -> str:
        """Pick the faster codec from rank 0's timings. All ranks must call."""
        medians = {c: sorted(t)[len(t) // 2] for c, t in self.times.items() if t}
        best = min(medians, key=medians.__getitem__) if self.world.is_root else None
        self.choice = self.world.broadcast_object(best, name="hvdtrain.auto.choice")
        self.medians = self.world.broadcast_object(medians, name="hvdtrain.auto.medians")
        return str(self.choice)


def codec_choice(world: World, compression: str, auto_steps: int) -> FixedCodec | AutoSelect:
    """What picks the gradient codec each step, for `comm.compression`."""
    return AutoSelect(world, auto_steps) if compression == "auto" else FixedCodec(compression)


def reducescatter_launch(world: World, codec: str, flat: torch.Tensor, name: str) -> tuple[Any, torch.Tensor | None]:
    """Start an averaging reduce-scatter (ZeRO-2) of a flat fp32 bucket whose length is a multiple
    of the world size; returns (pending, this rank's contribution as the wire carries it in fp32, or
    None if exact). All ranks must call with the same name."""
    if codec == "none":
        return ("none", world.reducescatter_async(flat, name=name, op="average")), None
    if codec == "fp16":
        # Divide in fp32 before the cast, as the fp16 allreduce codec does: partial sums cannot overflow.
        half = flat.div_(world.size).half()
        return ("fp16", world.reducescatter_async(half, name=name, op="sum")), half.float() * world.size
    # bf16: Horovod has no bf16 type; the bits travel as int16 and each rank sums its chunks in fp32.
    low = flat.bfloat16()
    return ("bf16", world.alltoall_async(low.view(torch.int16), name=name + ".a2a")), low.float()


def reducescatter_finish(world: World, pending: tuple[str, Any]) -> torch.Tensor:
    """Wait; return this rank's slice of the averaged bucket in fp32."""
    kind, handle = pending
    out = world.wait(handle)
    if kind == "none":
        return out
    if kind == "fp16":
        return out.float()
    chunks = out[0].view(torch.bfloat16).view(world.size, -1).float()
    return (chunks.sum(dim=0) / world.size).bfloat16().float()  # rounded like the bf16 allreduce codec's mean
