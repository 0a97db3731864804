"""Atomic checkpoints: one folder per step, written by rank 0 into a temp folder, fsynced and renamed;
the `latest` pointer moves only after the folder is complete; the last `keep` folders are kept.

Only rank 0 touches the file system, so hosts need no shared storage; what other ranks need comes
over Horovod. Decisions that gate later collectives (the save failed, the checkpoint is missing) are
agreed across ranks first, so a problem on rank 0 stops every rank instead of hanging them.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hvdtrain.config import CheckpointConfig
from hvdtrain.errors import CheckpointError
from hvdtrain.world import World

if TYPE_CHECKING:  # types only: the training pieces this module restores, not what it imports to run
    pass

FORMAT = 1
STATE_FILE = "state.pt"
LATEST = "latest"
# Config sections that change what the saved tensors mean; a difference there is refused.
_MUST_MATCH = ("task", "model")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, write: Any) -> None:
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def _reason(exc: BaseException) -> str:
    """One line for the user: `[Errno 28] No space left on device`, not a traceback. torch.save
    wraps the OSError of a failed write in a RuntimeError whose text is the C++ one."""
    for e in (exc, exc.__cause__, exc.__context__):
        if isinstance(e, OSError) and e.strerror:
            return f"{e.strerror}" if e.errno is None else f"[Errno {e.errno}] {e.strerror}"
    first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _config_diff(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    out = []
    for section in _MUST_MATCH:
        a, b = saved.get(section), current.get(section)
        if isinstance(a, dict) and isinstance(b, dict):
            keys = sorted(set(a) | set(b))
            out += [f"{section}.{k} ({a.get(k)!r} -> {b.get(k)!r})" for k in keys if a.get(k) != b.get(k)]
        elif a != b:
            out.append(f"{section} ({a!r} -> {b!r})")
    return out


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load one checkpoint folder (or its state file) without unpickling arbitrary objects."""
    p = Path(path)
    f = p / STATE_FILE if p.is_dir() else p
    if not f.is_file():
        raise CheckpointError(f"checkpoint {p} does not exist; check the path or start without --resume")
    try:
        state = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling/zip failure means the same to the user
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"checkpoint {f} is corrupt or not an hvdtrain checkpoint ({first}); "
                              "resume from an older one or start fresh") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {f} is not an hvdtrain checkpoint (format {FORMAT} expected)")
    return state


class Checkpointer:
    """Saves and restores training state; `save` and `restore` must be called by all ranks."""

    def __init__(self, cfg: CheckpointConfig, world: World) -> None:
        self.cfg, self.world = cfg, world
        self.dir = Path(cfg.dir) if cfg.dir else None

    def due(self, step: int, end_of_epoch: bool, last: bool) -> bool:
        """Every `every` steps (or at epoch ends), and always after the last step."""
        if self.dir is None:
            return False
        return last or (step % self.cfg.every == 0 if self.cfg.every else end_of_epoch)

    def save(self, step: int, state: dict[str, Any], config: dict[str, Any],
             rank_state: dict[str, Any] | None = None) -> Path | None:
        """Write `state` (rank 0's: the shared parts) and every rank's `rank_state` (per-rank parts)
        as folder step_<step>. All ranks call. A write that fails (a full disk, a lost mount) leaves
        the previous checkpoint as `latest` and no temp folder; then `checkpoint.on_error` decides,
        on every rank alike: stop raises CheckpointError, warn returns None and training goes on."""
        assert self.dir is not None
        # To rank 0 only: per-rank state can be large (ZeRO shards, pipeline stages), and no other
        # rank needs the others'.
        ranks = self.world.gather_object(rank_state or {}, name="hvdtrain.ckpt.ranks")
        final, error = self.dir / f"step_{step:08d}", ""
        if self.world.is_root:
            try:
                self._write(final, {**state, "step": step, "format": FORMAT, "ranks": ranks, "config": config})
            except Exception as exc:  # noqa: BLE001 - any failure on rank 0 must reach the other ranks
                error = f"could not write checkpoint {final.name} in {self.dir} ({_reason(exc)})"
        # Agreed so a full disk on rank 0 stops all ranks together rather than leaving them waiting.
        error = self.world.broadcast_object(error, name="hvdtrain.ckpt.saved")
        if not error:
            return final
        latest = self.latest()
        kept = f"the last good one, {latest.name}, is still `latest`" if latest else "there is no earlier checkpoint"
        if self.cfg.on_error == "stop":
            raise CheckpointError(f"{error}; {kept}; free space or set checkpoint.on_error=warn to train on")
        if self.world.is_root:
            print(f"hvdtrain: warning: step {step}: {error}; {kept}; training goes on (checkpoint.on_error=warn)",
                  file=sys.stderr, flush=True)
        return None

    def _write(self, final: Path, payload: dict[str, Any]) -> None:
        assert self.dir is not None
        self.dir.mkdir(parents=True, exist_ok=True)
        # Only rank 0 of one job writes here, so any temp folder is a leftover of a killed writer.
        for stale in self.dir.glob(".tmp-step_*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp, pointer = self.dir / f".tmp-{final.name}-{os.getpid()}", self.dir / f".{LATEST}.tmp"
        try:
            tmp.mkdir()
            _write_file(tmp / STATE_FILE, lambda f: torch.save(payload, f))
            text = json.dumps(payload["config"], indent=2, sort_keys=True).encode()
            _write_file(tmp / "config.json", lambda f: f.write(text))
            _fsync_dir(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            _write_file(pointer, lambda f: f.write(final.name.encode()))
            os.replace(pointer, self.dir / LATEST)
        except BaseException:
            # Nothing half-written stays: not the temp folder (it would fill the disk further), not a
            # folder that `latest` does not name (a resume would never pick it, pruning might keep it).
            shutil.rmtree(tmp, ignore_errors=True)
            pointer.unlink(missing_ok=True)
            if self.latest() != final:
                shutil.rmtree(final, ignore_errors=True)
            raise
        _fsync_dir(self.dir)
        self._prune()

    def _prune(self) -> None:
        assert self.dir is not None
        done = sorted(p for p in self.dir.glob("step_*") if p.is_dir())
        for old in done[: -self.cfg.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def latest(self) -> Path | None:
        """The folder the `latest` pointer names, or None if there is no checkpoint yet."""
        if self.dir is None or not (self.dir / LATEST).is_file():
            return None
        return self.dir / (self.dir / LATEST).read_text().strip()

    def restore(self, config: dict[str, Any]) -> dict[str, Any] | None:
        """Rank 0 loads the checkpoint `checkpoint.resume` names; every rank gets it (its "ranks" hold
        every rank's per-rank state, its "path" where it came from). All ranks call."""
        result: tuple[str, Any] = ("none", None)
        if self.world.is_root and self.cfg.resume:
            try:
                result = self._load_on_root(config)
            except CheckpointError as exc:
                result = ("error", str(exc))
            except Exception as exc:  # noqa: BLE001 - raising on rank 0 alone would hang the others
                result = ("error", f"could not restore checkpoint: {type(exc).__name__}: {exc}")
        status, payload = self.world.broadcast_object(result, name="hvdtrain.ckpt.restore")
        if status == "error":
            raise CheckpointError(payload)
        return payload

    def _load_on_root(self, config: dict[str, Any]) -> tuple[str, Any]:
        if self.cfg.resume in ("latest", "auto"):
            path = self.latest()
            if path is None:
                if self.cfg.resume == "auto":
                    return ("none", None)
                raise CheckpointError(f"no checkpoint in {self.dir} to resume from; run without --resume first")
        else:
            path = Path(self.cfg.resume)
        state = load_checkpoint(path)
        diff = _config_diff(state.get("config", {}), config)
        if diff:
            raise CheckpointError(f"checkpoint {path} was made with a different config: {', '.join(diff)}")
        state["path"] = str(path)
        return ("ok", state)
