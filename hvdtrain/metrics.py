"""Metrics: per-rank sums kept as tensors between log steps, averaged across ranks with one named
allreduce, and written by rank 0 only (JSONL and TensorBoard) through `RunLog`."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from hvdtrain.config import LogConfig
from hvdtrain.errors import ConfigError
from hvdtrain.tracking import MlflowRun
from hvdtrain.world import World


class MetricSums:
    """Running per-rank sums of loss x samples and each metric's batch sums, plus the sample count.

    Values stay as tensors (no .item(), so no host sync) until `reduce`, which all ranks must call
    at the same point; it averages by total samples, so unequal shards are weighted exactly.
    """

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.samples = 0

    def add(self, loss: torch.Tensor, batch_sums: dict[str, torch.Tensor], samples: int) -> None:
        # Accumulated in place, in fp64, on the values' device: a per-step .cpu() would make every
        # GPU step wait for its kernels, and fresh tensors per step cost more than the adds.
        for key, value, weight in (("loss", loss, samples), *((k, v, 1) for k, v in batch_sums.items())):
            acc = self.sums.get(key)
            if acc is None:
                acc = self.sums[key] = torch.zeros((), dtype=torch.float64, device=loss.device)
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                acc.add_(value.detach().reshape(()), alpha=weight)
            elif isinstance(value, (int, float)):  # a Python number is fine too (bool counts as 0/1)
                acc.add_(float(value) * weight)
            else:
                got = f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
                raise TypeError(f"loss_fn's metric {key!r} must be one number (a Python number or a one-element "
                                f"tensor: the batch's sum), got {got}")
        self.samples += samples

    def merge(self, other: MetricSums) -> None:
        """Adds another's sums (an attempt that was not retried) into these."""
        for key, value in other.sums.items():
            self.sums[key] = self.sums.get(key, 0) + value
        self.samples += other.samples

    def reduce(self, world: World, name: str, keys: tuple[str, ...]) -> dict[str, float]:
        """Averages over all ranks' samples. `keys` must be the same on every rank (a rank with an
        empty shard still contributes zeros), so the allreduce shape always matches."""
        vec = torch.zeros(len(keys) + 1, dtype=torch.float64)
        for i, key in enumerate(keys):
            if key in self.sums:
                vec[i] = self.sums[key].cpu()  # the one host sync, on logging steps only
        vec[-1] = self.samples
        total = world.allreduce(vec, name=name, op="sum")
        count = float(total[-1])
        self.sums, self.samples = {}, 0
        if count == 0:
            return {}
        return {key: float(total[i]) / count for i, key in enumerate(keys)}


class RunLog:
    """Rank 0 writes metrics.jsonl and TensorBoard events under `directory`, and with `mlflow` (the
    experiment name) an MLflow run (hvdtrain/tracking.py); other ranks write nothing. All ranks make
    one, together."""

    def __init__(self, world: World, directory: str, tensorboard: bool = True, mlflow: str | None = None) -> None:
        self.active = world.is_root and bool(directory)
        self.history: list[dict[str, Any]] = []
        self._file = None
        self._tb = None
        self.tracker: MlflowRun | None = None
        if mlflow is not None:
            # Rank 0 alone talks to MLflow; a failure there must stop every rank, not leave them waiting.
            error = ""
            if world.is_root:
                try:
                    self.tracker = MlflowRun(mlflow)
                except ConfigError as exc:
                    error = str(exc)
            error = world.broadcast_object(error, name="hvdtrain.log.mlflow")
            if error:
                raise ConfigError(error)
        if self.active:
            path = Path(directory)
            path.mkdir(parents=True, exist_ok=True)
            self._file = open(path / "metrics.jsonl", "a", buffering=1)
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(path / "tb"))

    def write(self, step: int, kind: str, values: dict[str, Any]) -> None:
        """Record `values` (kind: train, eval, event) at optimizer step `step`."""
        record = {"step": step, "kind": kind, "time": round(time.time(), 3), **values}
        self.history.append(record)
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(f"{kind}/{key}", value, step)
        if self.tracker is not None:
            self.tracker.record(step, kind, values)

    def close(self) -> None:
        if self.tracker is not None:
            self.tracker.close()
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()


class Progress:
    """Rank 0's tqdm bar and status lines; on other ranks (or with progress off) lines still print
    on rank 0 but nothing else happens."""

    def __init__(self, world: World, total: int, initial: int, enabled: bool) -> None:
        self.root = world.is_root
        # Under a launcher stderr is a pipe: redraw rarely so logs get a status line, not a flood.
        interval = 0.1 if sys.stderr.isatty() else 30.0
        self.bar = None
        if self.root and enabled:
            self.bar = tqdm(total=total, initial=initial, dynamic_ncols=True, mininterval=interval)

    def update(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def set_postfix(self, **values: Any) -> None:
        if self.bar is not None:
            self.bar.set_postfix(**values, refresh=False)

    def write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line)
        elif self.root:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class TrainLog:
    """Everything one `fit` reports: per-rank sums, their average every `every` steps (and at epoch
    ends), eval lines, events, the progress bar. `train_step_done` must be called on all ranks."""

    def __init__(self, world: World, cfg: LogConfig, total: int, initial: int) -> None:
        self.world, self.every = world, cfg.every
        self.sums = MetricSums()
        self.run = RunLog(world, cfg.dir, cfg.tensorboard, cfg.mlflow_experiment if cfg.mlflow else None)
        self.bar = Progress(world, total, initial, cfg.progress)
        self.last: dict[str, float] = {}
        self._clock, self._since, self._steps, self._sync_s = time.perf_counter(), 0, 0, 0.0
        self._said: set[str] = set()  # keys of the console notes said once per run

    def say_once(self, key: str, line: str) -> None:
        """Print `line` on rank 0 the first time `key` comes up in this run; later ones are silent."""
        if key not in self._said:
            self._said.add(key)
            self.bar.write(line)

    def train_step_done(self, step: int, samples: int, boundary: bool, sync_s: float | None = None,
                        **extra: Any) -> None:
        """Count one optimizer step of `samples` (global); average and write when due. `sync_s`:
        the reducer's seconds in `synchronize` so far, logged as comm_wait_ms per step (rank 0's)."""
        self.bar.update(1)
        self._since += samples
        self._steps += 1
        if step % self.every and not boundary:
            return
        stats = self.sums.reduce(self.world, "hvdtrain.train", tuple(self.sums.sums))
        now = time.perf_counter()
        stats.update(extra, samples_per_s=self._since / max(now - self._clock, 1e-9))
        if sync_s is not None:
            stats["comm_wait_ms"] = 1000 * (sync_s - self._sync_s) / max(self._steps, 1)
            self._sync_s = sync_s
        self._clock, self._since, self._steps, self.last = now, 0, 0, stats
        self.run.write(step, "train", stats)
        if "loss" in stats:
            self.bar.set_postfix(loss=f"{stats['loss']:.4f}")

    def evaluated(self, step: int, epoch: int, epochs: int, values: dict[str, float]) -> None:
        self.run.write(step, "eval", values)
        shown = " ".join(f"{k} {v:.4f}" for k, v in values.items())
        loss = f"train loss {self.last['loss']:.4f} | " if "loss" in self.last else ""
        self.bar.write(f"epoch {epoch + 1}/{epochs} step {step}: {loss}eval {shown}")

    def event(self, step: int, name: str, **values: Any) -> None:
        self.run.write(step, "event", {"event": name, **values})

    def close(self) -> None:
        self.bar.close()
        self.run.close()
