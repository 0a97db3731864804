"""Fixtures the container tests share: the CPU image, built once per session with rootful podman."""

import os
import shutil
import time
from pathlib import Path

import pytest
from launch import ROOT, run

HOST_CA = Path(os.environ.get("PIP_CERT") or "/etc/ssl/certs/ca-certificates.crt")
WHEELS = Path("/opt/wheels")  # a local torch wheel folder, where this machine has one (pip's find-links)
CACHE = Path(os.environ.get("HVDTRAIN_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
             / "hvdtrain")
CPU_IMAGE = "localhost/hvdtrain:cpu-test"


def podman(*args: str, timeout: float = 120, check: bool = True, **kw):
    """podman with the configuration scripts/container-base.sh keeps (no Docker engine here)."""
    return run([str(ROOT / "scripts/container-base.sh"), "podman", *args], timeout=timeout, check=check, **kw)


def why_no_podman_build() -> str | None:
    if os.geteuid() != 0:
        return "needs root: rootful podman builds the image here (scripts/container-base.sh, docker/README.md)"
    if not shutil.which("apt-get") and not shutil.which("podman"):
        return "needs podman, or apt-get to install it (scripts/container-base.sh)"
    return None


def build_args(dockerfile: str, tag: str) -> list[str]:
    """podman build arguments: build-time-only mounts of the proxy's CA bundle, a local torch wheel
    folder and the Horovod wheel cache, none of which is copied into the image."""
    args = ["build", "--pull=never", "--format", "docker", "--network", "host", "-f", f"docker/{dockerfile}",
            "-t", tag, "-v", f"{HOST_CA}:/mnt/host-ca.crt:ro", "--build-arg", "PIP_CERT=/mnt/host-ca.crt"]
    if CACHE.is_dir():
        args += ["-v", f"{CACHE}:/mnt/hvdtrain-cache:ro"]
    return args


@pytest.fixture(scope="session")
def cpu_image() -> dict:
    """The CPU image (docker/Dockerfile.cpu) built from this checkout; {"tag", "build_s"}."""
    reason = why_no_podman_build()
    if reason:
        pytest.skip(reason)
    run([str(ROOT / "scripts/container-base.sh")], timeout=600)
    args = build_args("Dockerfile.cpu", CPU_IMAGE)
    if WHEELS.is_dir() and list(WHEELS.glob("torch-*.whl")):
        args += ["-v", f"{WHEELS}:/mnt/wheels:ro", "--build-arg", "PIP_FIND_LINKS=/mnt/wheels",
                 "--build-arg", "TORCH_INDEX="]
    t0 = time.monotonic()
    podman(*args, ".", timeout=1200)
    yield {"tag": CPU_IMAGE, "build_s": time.monotonic() - t0}
    podman("image", "prune", "-f", check=False)  # layers of earlier builds; the tagged image stays cached
