"""The documented multi-node container setup, for real: one container of the CPU image per host
(two network-namespace hosts of scripts/testbed.sh), sshd on port 2222 in each with one key pair
mounted as the image user's ~/.ssh, and horovodrun -H hostA:1,hostB:1 -p 2222 started in one of
them. The trained model equals a one-host run of the same global batch. Needs root (namespaces,
rootful podman); elsewhere the test skips with the reason."""

from __future__ import annotations

import os
import re
import subprocess

import pytest
import torch
from conftest import podman, why_no_podman_build
from launch import BIN, ROOT, env, run

from hvdtrain.checkpoint import load_checkpoint

pytestmark = [pytest.mark.netns, pytest.mark.slow]

TESTBED = str(ROOT / "scripts" / "testbed.sh")
PREFIX = f"hvdc{os.getpid() % 100000}"
HOSTS = [f"{PREFIX}-n{i}" for i in range(2)]
NET = "10.213.9"
STEPS, PER_RANK = 10, 16
TRAIN = ["train", "--config", "configs/digits.yaml", "--set", f"train.max_steps={STEPS}", "--set",
         "log.progress=false", "--set", "optim.lr_scaling=none"]  # the same lr for 2 x 16 and 1 x 32


def why_not() -> str | None:
    from test_multihost import why_no_netns

    return why_no_podman_build() or why_no_netns()


@pytest.fixture(scope="module")
def bed(tmp_path_factory):
    reason = why_not()
    if reason:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("containers")
    e = env(HVD_TESTBED_PREFIX=PREFIX, HVD_TESTBED_DIR=str(tmp / "state"), HVD_TESTBED_NET=NET)
    try:
        run([TESTBED, "up", str(len(HOSTS))], timeout=300, env=e)  # no rate limit: the test is about setup
        yield {"env": e, "tmp": tmp}
    finally:
        for host in HOSTS:
            podman("rm", "-f", "-t", "0", f"{host}-worker", check=False)
        run([TESTBED, "down"], timeout=60, env=e, check=False)


def ssh_folder(tmp) -> str:
    """One key pair for every container, as the image user's ~/.ssh (uid 1000 owns it, as docs say)."""
    keys = tmp / "hvd-ssh"
    keys.mkdir()
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / "id_ed25519")], check=True)
    (keys / "authorized_keys").write_text((keys / "id_ed25519.pub").read_text())
    for p in [keys, *keys.iterdir()]:
        os.chown(p, 1000, 1000)
    keys.chmod(0o700)
    return str(keys)


def in_host(bed: dict, i: int, *podman_args: str, timeout: float = 300, check: bool = True):
    """A container in testbed host i: it joins that host's network namespace (its address, its
    links; `ip netns exec` would also remount /sys, where runc then finds no cgroups), with its
    hostname and the testbed's /etc/hosts for it."""
    hosts = f"/etc/netns/{HOSTS[i]}/hosts"
    cmd = [str(ROOT / "scripts/container-base.sh"), "podman", *podman_args[:1], "--network",
           f"ns:/run/netns/{HOSTS[i]}", "--hostname", HOSTS[i], "--no-hosts", "-v", f"{hosts}:/etc/hosts:ro",
           *podman_args[1:]]
    return run(cmd, timeout=timeout, check=check, env=bed["env"])


@pytest.mark.timeout(1500)
def test_two_containers_on_two_hosts_train_across_them_like_one_host(bed, cpu_image, tmp_path):
    image, keys = cpu_image["tag"], ssh_folder(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    out.chmod(0o777)  # rank 0 writes as uid 1000
    mounts = ["-v", f"{keys}:/home/hvd/.ssh:ro", "-v", f"{out}:/checkpoints"]
    # Host 1: a worker container that only runs sshd on port 2222 (host keys made at its start).
    in_host(bed, 1, "run", "-d", "--name", f"{HOSTS[1]}-worker", *mounts, image, "start-sshd")
    # Host 0: sshd too (horovodrun checks every host over ssh), then the launch from inside it.
    script = (f"start-sshd >/tmp/sshd.log 2>&1 & sleep 2; "
              f"horovodrun -np 2 -H {HOSTS[0]}:1,{HOSTS[1]}:1 -p 2222 --gloo "
              f"hvdtrain {' '.join(TRAIN)} --set train.batch_size={PER_RANK} --out /checkpoints/run")
    text = in_host(bed, 0, "run", "--rm", *mounts, image, "bash", "-c", script, timeout=900).stdout
    m = re.search(r"done: step (\d+), eval loss [\d.]+ accuracy [\d.]+", text)
    assert m and int(m.group(1)) == STEPS, text[-4000:]
    assert "hvdtrain: 2 rank(s)" in text
    # Rank 1 ran in the worker container on host 1: its sshd logged the login of the image user.
    worker_log = podman("logs", f"{HOSTS[1]}-worker").stdout + podman("logs", f"{HOSTS[1]}-worker").stderr
    assert re.search(rf"Accepted publickey for hvd from {re.escape(NET)}\.10 ", worker_log), worker_log[-2000:]

    # The same global batch (2 x 16) on one host, one process, outside any container.
    ref = tmp_path / "ref"
    one = run([str(BIN / "hvdtrain"), *TRAIN, "--set", f"train.batch_size={2 * PER_RANK}", "--out", str(ref)],
              timeout=300).stdout
    assert re.search(r"done: step (\d+)", one).group(1) == str(STEPS)
    model = load_checkpoint(out / "run" / "checkpoints" / f"step_{STEPS:08d}")["model"]
    expected = load_checkpoint(ref / "checkpoints" / f"step_{STEPS:08d}")["model"]
    assert model.keys() == expected.keys()
    for name, want in expected.items():
        # Same samples and mean gradient; only the summation order differs (ring vs one batch).
        torch.testing.assert_close(model[name], want, rtol=1e-4, atol=1e-5, msg=name)
