"""`hvdtrain build-horovod`: Horovod 0.28.1 built for the torch of this Python environment and
installed into it, for an hvdtrain installed with `pip install .` (pip itself cannot build it: it
would build in isolation, without torch, as C++14, which PyTorch >= 2.1 rejects). Runs the
project's recipe (scripts/install.sh, shipped in the package): the C++17 and Gloo AVX fp16
patches, a wheel cached per Python, torch, MPI and CUDA in ~/.cache/hvdtrain, reused next time.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from importlib import resources
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cuda", default=os.environ.get("HVDTRAIN_CUDA", ""), metavar="TAG",
                   help="build NCCL GPU operations for this CUDA tag (cu130: toolchain from PyPI); default CPU")
    p.add_argument("--without-mpi", action="store_true", help="Gloo only (no Open MPI on this machine)")


def recipe() -> Path:
    """The packaged scripts/install.sh (in a checkout's editable install, the checkout's own)."""
    return Path(str(resources.files("hvdtrain.install").joinpath("install.sh")))


def run(args: argparse.Namespace) -> int:
    cache = Path(os.environ.get("HVDTRAIN_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or
                                                             Path.home() / ".cache") / "hvdtrain")
    env = dict(os.environ, HVDTRAIN_PYTHON=sys.executable, HVDTRAIN_CUDA=args.cuda,
               HVDTRAIN_WITHOUT_MPI="1" if args.without_mpi else os.environ.get("HVDTRAIN_WITHOUT_MPI", "0"))
    env.setdefault("HVDTRAIN_LOG_DIR", str(cache / "logs"))  # not into site-packages
    return subprocess.run(["bash", str(recipe()), "horovod"], env=env).returncode
