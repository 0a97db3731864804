"""Per-step memory profiler: bytes of parameters, gradients, optimizer state and activations, and
the step's peak.

Tensor categories are exact bytes of distinct storages (tied weights and views count once).
Activations are what autograd keeps between forward and backward: every tensor saved for backward
(seen through `saved_tensors_hooks`, parameters and buffers excluded) plus the inputs a checkpointed
block holds for its recomputation; with several micro-batches, the largest one. The peak is the CUDA
allocator's maximum during the step on GPU, and the process's peak resident set (VmHWM, reset at
each step through /proc/self/clear_refs) on CPU, which also counts the interpreter, libraries and data.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hvdtrain.allocator import malloc_trim
from hvdtrain.config import Config, parse_steps
from hvdtrain.world import World

CATEGORIES = ("params", "grads", "optimizer", "activations", "peak")


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (a tensor and its views count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def reset_peak_rss() -> bool:
    """Reset the process's VmHWM to its current RSS; False where /proc/self/clear_refs is not
    writable (some sandboxes), so VmHWM stays the lifetime peak. Freed heap blocks that glibc keeps
    (more of them once `allocator.pin_malloc` ran) are given back first, or the resident set would
    stay at the largest earlier step and a smaller step's peak could not show."""
    malloc_trim()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def proc_status() -> dict[str, int]:
    """VmRSS and VmHWM of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


class ActivationMeter:
    """Counts bytes autograd saves for backward while active. A pack after an unpack means the
    previous micro-batch's backward ran, so counting restarts and the largest micro-batch is kept."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.peak = self._current = 0
        self._storages: set[int] = set()
        self._exclude: set[int] = set()
        self._in_backward = False
        self._hooks = [m.register_forward_pre_hook(self._on_checkpointed_input)
                       for m in model.modules() if getattr(m, "hvdtrain_checkpointed", False)]

    def _add(self, t: torch.Tensor) -> None:
        if self._in_backward:
            self.peak, self._current, self._in_backward = max(self.peak, self._current), 0, False
            self._storages.clear()
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
            return  # a weight (ZeRO-3 gathers them into storages that did not exist when counting began)
        try:
            s = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse or storage-less tensors: not counted
            return
        ptr = s.data_ptr()
        if ptr not in self._storages and ptr not in self._exclude:
            self._storages.add(ptr)
            self._current += s.nbytes()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self._add(t)
        return t

    def _unpack(self, t: torch.Tensor) -> torch.Tensor:
        self._in_backward = True
        return t

    def _on_checkpointed_input(self, module: nn.Module, args: tuple) -> None:
        # A checkpointed block keeps only its inputs until backward; autograd never sees them as saved.
        if self._active and torch.is_grad_enabled():
            for a in args:
                if isinstance(a, torch.Tensor):
                    self._add(a)

    _active = False

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        self.peak = self._current = 0
        self._storages.clear()
        self._in_backward = False
        tensors = [*self.model.parameters(), *self.model.buffers()]
        self._exclude = {t.untyped_storage().data_ptr() for t in tensors}
        self._active = True
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._active = False
            self.peak = max(self.peak, self._current)
            self._storages.clear()

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()


class _Saved:
    """A tensor saved for backward, as `LiveActivations` holds it: its storage is counted until
    autograd lets go of it (after the backward that used it)."""

    __slots__ = ("tensor", "_meter", "_ptr")

    def __init__(self, meter: LiveActivations, tensor: torch.Tensor, ptr: int) -> None:
        self.tensor, self._meter, self._ptr = tensor, meter, ptr

    def __del__(self) -> None:
        self._meter.release(self._ptr)


class LiveActivations:
    """Peak bytes of activations alive at once: storages saved for backward (weights excluded) from
    when a forward saves them until the backward that used them has run. With a pipeline schedule
    several micro-batches' activations are alive together; ActivationMeter counts one micro-batch."""

    def __init__(self, weights: Iterable[torch.Tensor]) -> None:
        self._exclude = {t.untyped_storage().data_ptr() for t in weights}
        self._alive: dict[int, list[int]] = {}  # storage -> [bytes, saved references]
        self.current = self.peak = 0

    def _pack(self, t: torch.Tensor) -> Any:
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
            return t
        try:
            s = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return t
        ptr = s.data_ptr()
        if ptr in self._exclude:
            return t
        entry = self._alive.setdefault(ptr, [s.nbytes(), 0])
        if entry[1] == 0:
            self.current += entry[0]
            self.peak = max(self.peak, self.current)
        entry[1] += 1
        return _Saved(self, t, ptr)

    @staticmethod
    def _unpack(saved: Any) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    def release(self, ptr: int) -> None:
        entry = self._alive.get(ptr)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self._alive[ptr]

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        self.peak = self.current
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield


class MemoryProfiler:
    """`memory.profile` and `memory.trace_steps`. `step(n)` wraps one training step; `finish` must be
    called by all ranks at the end (one named allreduce for the table)."""

    def __init__(self, world: World, cfg: Config, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.world, self.enabled, self.model, self.optimizer = world, cfg.memory.profile, model, optimizer
        self.log_dir = Path(cfg.log.dir) if cfg.log.dir else None
        self.trace = parse_steps(cfg.memory.trace_steps) if cfg.memory.trace_steps else None
        self.figures: dict[str, int] = {}
        self.maxima = dict.fromkeys(CATEGORIES, 0)
        self.cuda = world.device.type == "cuda"
        self._profiler: Any = None
        self._meter = ActivationMeter(model) if self.enabled else None
        self._hooks = []
        if self.enabled:
            self._hooks = [optimizer.register_step_pre_hook(self._count_grads),
                           optimizer.register_step_post_hook(self._count_state)]
            if self.cuda:
                torch.cuda.memory._record_memory_history(max_entries=100_000)

    def _count_grads(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        self.figures["grads"] = storage_bytes(grads)

    def _count_state(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        self.figures["optimizer"] = storage_bytes(optimizer_tensors(optimizer))

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Around optimizer step `step + 1` (the counter before it runs)."""
        self._maybe_start_trace(step + 1)
        if self._meter is None:  # profiling off
            yield
            self._maybe_stop_trace(step + 1)
            return
        self._reset_peak()
        try:
            with self._meter.measure():
                yield
        except torch.OutOfMemoryError:
            self._dump_oom_snapshot()
            raise
        # The optimizer's parameters too: under ZeRO-3 they are this rank's slices, and the model's
        # own are gathered only while in use (a slice that is a view of a model weight counts once).
        self.figures["params"] = storage_bytes([*self.model.parameters(),
                                                *(p for g in self.optimizer.param_groups for p in g["params"])])
        self.figures["activations"] = self._meter.peak
        self.figures.update(self._read_peak())
        for key in CATEGORIES:
            self.maxima[key] = max(self.maxima[key], self.figures.get(key, 0))
        self._maybe_stop_trace(step + 1)

    def _reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.world.device)
            return
        self._rss_reset = reset_peak_rss()

    def _read_peak(self) -> dict[str, Any]:
        if self.cuda:
            return {"peak": torch.cuda.max_memory_allocated(self.world.device),
                    "reserved": torch.cuda.memory_reserved(self.world.device)}
        status = proc_status()
        # Without clear_refs (some sandboxes) VmHWM is the lifetime peak: still an upper bound.
        return {"peak": status["VmHWM"], "rss": status["VmRSS"], "peak_is_lifetime": not self._rss_reset}

    def _dump_oom_snapshot(self) -> None:
        # Runs only on a CUDA out-of-memory error; the file opens in pytorch.org/memory_viz.
        if self.cuda:
            path = (self.log_dir or Path(".")) / f"oom_snapshot_rank{self.world.rank}.pickle"
            torch.cuda.memory._dump_snapshot(str(path))
            print(f"hvdtrain: rank {self.world.rank}: CUDA out of memory; memory snapshot in {path}", flush=True)

    def _maybe_start_trace(self, n: int) -> None:
        if self.trace and n == self.trace[0] and self.world.is_root:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            self._profiler = profile(activities=acts, profile_memory=True, record_shapes=True)
            self._profiler.start()

    def _maybe_stop_trace(self, n: int) -> None:
        if self._profiler is not None and self.trace is not None and n == self.trace[1]:
            self._profiler.stop()
            self._profiler.export_chrome_trace(str(self.trace_path()))
            self._profiler = None

    def trace_path(self) -> Path:
        assert self.trace is not None and self.log_dir is not None
        return self.log_dir / f"trace_steps_{self.trace[0]}-{self.trace[1]}.json"

    def record(self, step: int, log: Any, due: bool) -> None:
        """Write this step's figures to the metrics log (kind "memory") on logging steps."""
        if self.enabled and due and self.figures:
            log.run.write(step, "memory", dict(self.figures))

    def close(self) -> None:
        """Remove the hooks (idempotent); `finish` calls it."""
        if self._profiler is not None and self.trace is not None:  # the run ended inside the trace window
            self._maybe_stop_trace(self.trace[1])
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._meter is not None:
            self._meter.remove()
        if self.enabled and self.cuda:
            torch.cuda.memory._record_memory_history(enabled=None)

    def finish(self, log: Any, step: int) -> None:
        """The largest figures over steps and ranks, as a table on rank 0. All ranks must call."""
        self.close()
        if not self.enabled:
            return
        local = torch.tensor([float(self.maxima[k]) for k in CATEGORIES], dtype=torch.float64)
        every = self.world.allreduce(local, name="hvdtrain.memprof.max", op="max")
        top = {k: int(v) for k, v in zip(CATEGORIES, every.tolist())}
        log.event(step, "memory_summary", **top)
        log.bar.write(summary_table(top, self.cuda))


def summary_table(figures: dict[str, int], cuda: bool) -> str:
    peak = "peak (CUDA allocated)" if cuda else "peak (process RSS)"
    names = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer state",
             "activations": "activations (saved)", "peak": peak}
    lines = ["memory per rank (largest step, largest rank)", f"{'category':<24}{'MiB':>12}"]
    lines += [f"{names[k]:<24}{figures[k] / 2**20:>12.2f}" for k in CATEGORIES]
    return "\n".join(lines)
