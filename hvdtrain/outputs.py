"""The run's output folders (log.dir, checkpoint.dir), checked before Horovod starts.

A folder that cannot be written (an existing file in its place, no permission, a read-only mount, a
name too long) otherwise fails at the first metrics line or checkpoint, after every rank has set up
Horovod and maybe trained for an epoch. The check leaves nothing behind: it finds the nearest folder
that exists, asks the kernel whether this process may write there, and makes and removes one empty
folder in it.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

from hvdtrain.config import Config
from hvdtrain.errors import ConfigError

# Set by horovodrun (Gloo), Open MPI, PMIx/Slurm: this process's rank before Horovod starts.
_RANK_VARS = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")


def launch_rank(env: Mapping[str, str]) -> int:
    """This process's rank as its launcher set it (0 when started alone)."""
    for var in _RANK_VARS:
        if env.get(var, "").isdigit():
            return int(env[var])
    return 0


def check_folder(field: str, path: str) -> None:
    """Raise ConfigError naming `field` if folder `path` cannot be created and written by this
    process. Leaves nothing behind."""
    p = Path(path).expanduser().absolute()
    try:
        max_name = os.pathconf("/", "PC_NAME_MAX")
        max_path = os.pathconf("/", "PC_PATH_MAX")
    except (OSError, ValueError):
        max_name, max_path = 255, 4096
    long = next((part for part in p.parts if len(part.encode()) > max_name), None)
    if long is not None or len(str(p).encode()) >= max_path:
        what = f"the name {long[:40]}... is longer than {max_name} bytes" if long else f"it is {max_path}+ bytes long"
        raise ConfigError(f"{field}={path}: {what}; choose a shorter path")
    existing = p
    try:
        while not existing.exists():
            if existing.is_symlink():
                raise ConfigError(f"{field}={path}: {existing} is a broken symbolic link")
            existing = existing.parent
    except PermissionError:
        raise ConfigError(f"{field}={path}: no permission to look inside {existing.parent} (as user {_user()}); "
                          "choose a path this user can reach") from None
    if not existing.is_dir():
        raise ConfigError(f"{field}={path} is a file, not a folder; choose another path" if existing == p else
                          f"{field}={path}: {existing} is a file, so no folder can be made under it")
    if os.statvfs(existing).f_flag & os.ST_RDONLY:
        raise ConfigError(f"{field}={path}: {existing} is on a read-only file system; choose a writable path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{field}={path}: no permission to write in {existing} (as user {_user()}); "
                          "choose a writable path")
    try:  # what access(2) cannot tell: ACLs, quotas, pseudo file systems (/proc) refuse a real mkdir
        os.rmdir(tempfile.mkdtemp(prefix=".hvdtrain-probe-", dir=existing))
    except OSError as exc:
        raise ConfigError(f"{field}={path}: cannot create a folder in {existing} ({exc.strerror}); "
                          "choose a writable path") from None


def check_outputs(cfg: Config, env: Mapping[str, str] | None = None) -> None:
    """The folders rank 0 writes (metrics, checkpoints), checked on rank 0 before Horovod starts: a
    bad one ends rank 0 with one line, and its launcher then ends the other ranks."""
    if launch_rank(os.environ if env is None else env) != 0:
        return
    for field, path in (("log.dir", cfg.log.dir), ("checkpoint.dir", cfg.checkpoint.dir)):
        if path:
            check_folder(field, path)


def _user() -> str:
    try:
        import pwd

        return pwd.getpwuid(os.geteuid()).pw_name
    except (ImportError, KeyError):
        return str(os.geteuid())
