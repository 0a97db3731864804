"""Multi-host for real: ranks launched over ssh into network-namespace hosts (scripts/testbed.sh).

Each rank prints its hostname and network-namespace inode before training, so the tests can check
that ranks ran where the host list put them; the trained model must equal a one-host run of the
same global batch. Needs root (namespaces, unshare); elsewhere every test skips with the reason.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
import torch
from launch import BIN, ROOT, env, finish, run, wait_for_step

from hvdtrain.checkpoint import load_checkpoint

pytestmark = pytest.mark.netns

TESTBED = str(ROOT / "scripts" / "testbed.sh")
PREFIX = f"hvdt{os.getpid() % 100000}"  # unique per session: a concurrent copy cannot clash
HOSTS = [f"{PREFIX}-n{i}" for i in range(3)]
RATE = "200mbit"
NET = "10.213.7"
STEPS, PER_RANK = 12, 16
TRAIN = ["train", "--config", "configs/digits.yaml", "--set", f"train.max_steps={STEPS}", "--set",
         "log.progress=false", "--set", "optim.lr_scaling=none"]  # same lr for 3x16 and 1x48
PROBE = """import os, socket, sys
rank = os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK"))
print(f"whoami rank={rank} host={socket.gethostname()} netns={os.stat('/proc/self/ns/net').st_ino}", flush=True)
os.execvp(sys.argv[1], sys.argv[1:])
"""


def why_no_netns() -> str | None:
    if os.geteuid() != 0:
        return "multi-host tests need root: network namespaces, bind mounts and unshare (see docs/multihost.md)"
    probe = subprocess.run(["unshare", "--net", "--uts", "--mount", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create namespaces here (needs CAP_SYS_ADMIN and CAP_NET_ADMIN): {probe.stderr.strip()}"
    return None


@pytest.fixture(scope="module")
def bed(tmp_path_factory):
    reason = why_no_netns()
    if reason:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("multihost")
    e = env(HVD_TESTBED_PREFIX=PREFIX, HVD_TESTBED_DIR=str(tmp / "state"), HVD_TESTBED_NET=NET)
    (tmp / "probe.py").write_text(PROBE)
    try:
        # First use on a fresh machine installs openssh-server/iperf3 through apt: allow for it.
        run([TESTBED, "up", str(len(HOSTS)), RATE], timeout=300, env=e)
        yield {"env": e, "tmp": tmp, "probe": str(tmp / "probe.py")}
    finally:
        run([TESTBED, "down"], timeout=60, env=e, check=False)  # also reaps ranks a failed job left behind
        assert not [n for n in HOSTS if Path(f"/run/netns/{n}").exists()], "testbed namespaces left behind"


@pytest.fixture(scope="module")
def one_host(tmp_path_factory):
    """The reference: one process, no launcher, global batch 3 x 16 = 48."""
    out = tmp_path_factory.mktemp("one-host")
    text = run([str(BIN / "hvdtrain"), *TRAIN, "--set", f"train.batch_size={3 * PER_RANK}", "--out", str(out)],
               timeout=180).stdout
    return {"done": done_line(text), "model": final_model(out)}


def done_line(text: str) -> str:
    m = re.search(r"done: step (\d+), eval loss [\d.]+ accuracy [\d.]+", text)
    assert m and int(m.group(1)) == STEPS, text[-3000:]
    return m.group(0)


def final_model(out: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(out / "checkpoints" / f"step_{STEPS:08d}")["model"]


def netns_inode(host: str) -> int:
    return os.stat(f"/run/netns/{host}").st_ino


def placements(text: str) -> dict[int, tuple[str, int]]:
    """rank -> (hostname, netns inode) from the probe lines."""
    found = re.findall(r"whoami rank=(\d+) host=(\S+) netns=(\d+)", text)
    return {int(r): (h, int(n)) for r, h, n in found}


def assert_same_training(text: str, out: Path, one_host: dict) -> None:
    assert done_line(text) == one_host["done"]
    model = final_model(out)
    assert model.keys() == one_host["model"].keys()
    for name, ref in one_host["model"].items():
        # Same samples and mean gradient; only the summation order differs (ring vs one batch).
        torch.testing.assert_close(model[name], ref, rtol=1e-4, atol=1e-5, msg=name)


def in_testbed(bed: dict, cmd: list[str], timeout: float = 150) -> str:
    return run([TESTBED, "run", *cmd], timeout=timeout, env=bed["env"]).stdout


def test_hosts_have_own_names_addresses_and_no_way_out(bed):
    status = run([TESTBED, "status"], env=bed["env"]).stdout
    assert all(h in status for h in HOSTS) and f"link {RATE}" in status
    inodes = {netns_inode(h) for h in HOSTS}
    assert len(inodes) == 3 and os.stat("/proc/self/ns/net").st_ino not in inodes
    for i, host in enumerate(HOSTS):
        # `ip route get` only looks the route up: nothing is sent.
        out = run([TESTBED, "run", "-h", str(i), "sh", "-c",
                   "hostname; getent hosts $(hostname); ip route; ip route get 203.0.113.1 2>&1 || true"],
                  env=bed["env"]).stdout.splitlines()
        assert out[0] == host and out[1].split() == [f"{NET}.{10 + i}", host]  # routable, not 127.0.1.1
        assert not any(line.startswith("default") for line in out) and "Network is unreachable" in out[-1]
    again = run([TESTBED, "up", "3", RATE], env=bed["env"], timeout=30).stdout
    assert "(already)" in again  # idempotent: the same hosts, nothing restarted


def test_goodput_is_one_json_line_near_the_link_rate(bed):
    lines = run([TESTBED, "goodput", "0", "1", "2"], env=bed["env"], timeout=60).stdout.strip().splitlines()
    result = json.loads(lines[-1])
    assert result["from"] == HOSTS[0] and result["to"] == HOSTS[1] and result["link"] == RATE
    assert 120 < result["goodput_mbit_s"] <= 205, result  # tbf at 200 Mbit/s; TCP/IP headers take ~5%


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_uneven_slots_across_hosts_equal_one_host_run(bed, one_host, controller):
    out = bed["tmp"] / f"uneven-{controller}"
    text = in_testbed(bed, [str(BIN / "horovodrun"), "--disable-cache", "-np", "3", "-H",
                            f"{HOSTS[1]}:2,{HOSTS[2]}:1", f"--{controller}", str(BIN / "python"), bed["probe"],
                            str(BIN / "hvdtrain"), *TRAIN, "--set", f"train.batch_size={PER_RANK}", "--out", str(out)])
    # Launched from host 0, every rank went over ssh: two on host 1, one on host 2.
    assert placements(text) == {0: (HOSTS[1], netns_inode(HOSTS[1])), 1: (HOSTS[1], netns_inode(HOSTS[1])),
                                2: (HOSTS[2], netns_inode(HOSTS[2]))}, text[-3000:]
    assert_same_training(text, out, one_host)


@pytest.mark.parametrize("launcher", ["horovodrun", "hvdtrain-launch"])
def test_hostfile_across_three_hosts_equal_one_host_run(bed, one_host, launcher):
    hostfile = bed["tmp"] / "hostfile"
    hostfile.write_text("".join(f"{h} slots=1\n" for h in HOSTS))
    out = bed["tmp"] / f"hostfile-{launcher}"
    job = [str(BIN / "python"), bed["probe"], str(BIN / "hvdtrain"), *TRAIN, "--set", f"train.batch_size={PER_RANK}",
           "--out", str(out)]
    if launcher == "horovodrun":  # plain horovodrun --hostfile with Gloo
        cmd = [str(BIN / "horovodrun"), "--disable-cache", "-np", "3", "--hostfile", str(hostfile), "--gloo", *job]
    else:  # hvdtrain launch with MPI: preflight, then ring allreduce forced through --mpi-args
        cmd = [str(BIN / "hvdtrain"), "launch", "--hostfile", str(hostfile), "--controller", "mpi",
               "--network-interface", "eth0", "--", *job]
    text = in_testbed(bed, cmd)
    assert placements(text) == {i: (h, netns_inode(h)) for i, h in enumerate(HOSTS)}, text[-3000:]
    if launcher != "horovodrun":
        assert "hvdtrain: preflight ok: 3 host(s), 3 slot(s)" in text
        assert "--mca coll_tuned_use_dynamic_rules 1 --mca coll_tuned_allreduce_algorithm 4" in text
    assert_same_training(text, out, one_host)


def test_launch_preflight_names_each_bad_host_and_starts_nothing(bed):
    ghost = f"{PREFIX}-ghost"  # not in the hosts files, and the namespaces have no DNS
    result = run([TESTBED, "run", str(BIN / "hvdtrain"), "launch", "--hosts", f"{HOSTS[1]}:1,{ghost}:1",
                  "--network-interface", "ib9", "--", "false"], env=bed["env"], timeout=60, check=False)
    lines = result.stdout.strip().splitlines()
    assert result.returncode == 2, result.stdout
    assert len(lines) == 3, result.stdout
    assert lines[0] == f"hvdtrain: preflight: host {HOSTS[1]}: network interface ib9 not found (has: eth0, lo)"
    assert lines[1].startswith(f"hvdtrain: preflight: host {ghost}: not reachable over ssh: ssh: Could not resolve")
    assert lines[-1] == "hvdtrain: error: preflight failed: 2 problem(s) on 2 host(s); nothing was started"


def test_launch_preflight_catches_a_hostname_that_resolves_to_loopback(bed):
    # Gloo trap 1, for real: `run` gives the command its own UTS namespace, so renaming it is local.
    # With a second host: alone, a host's ranks meet on loopback and the name does not matter.
    result = run([TESTBED, "run", "sh", "-c", f"hostname localhost && exec {BIN / 'hvdtrain'} launch "
                  f"--hosts localhost:1,{HOSTS[1]}:1 --controller gloo -- true"], env=bed["env"], timeout=60,
                 check=False)
    assert result.returncode == 2, result.stdout
    assert result.stdout.startswith("hvdtrain: preflight: host localhost: hostname localhost resolves to loopback "
                                    "127.0.0.1; Gloo needs it to resolve to the host's routable address"), result.stdout


def test_bench_train_runs_all_three_ways_across_hosts(bed):
    # Launched from host 0 onto hosts 1 and 2: horovodrun -H for hvdtrain and the Horovod loop, one
    # torchrun per host (node ranks, static rendezvous on host 1) for DDP.
    text = in_testbed(bed, [str(BIN / "hvdtrain"), "bench", "train", "--tasks", "digits", "--set", "model.width=4",
                            "--np", "2", "--hosts", f"{HOSTS[1]}:1,{HOSTS[2]}:1", "--controllers", "gloo",
                            "--steps", "2", "--warmup", "1", "--repeats", "1"], timeout=240)
    runs = [json.loads(line) for line in text.splitlines() if line.startswith('{"bench": "train-run"')]
    assert [r["mode"] for r in runs] == ["hvdtrain", "horovod", "ddp"], text[-3000:]
    for r in runs:
        assert r["hosts"] == f"{HOSTS[1]}:1,{HOSTS[2]}:1" and r["rank_hosts"] == HOSTS[1:], r
    assert all(abs(r["last_loss"] - runs[0]["last_loss"]) <= 1e-4 * runs[0]["last_loss"] for r in runs)


SLOW = str(ROOT / "tests" / "integration" / "scripts" / "slow_train.py")
ALIVE = "9"  # s of silence before ssh gives up on a host (default 30): shorter runs, the same path
SLOW_TRAIN = ["train", "--config", "configs/digits.yaml", "--set", "train.epochs=50", "--set", "train.max_steps=1000",
              "--set", "log.every=1", "--set", "log.progress=false", "--set", "log.tensorboard=false",
              "--set", "train.stall_timeout=60"]


def link(host: str, state: str) -> None:
    """Take host's one link down or up (its veth end, inside its namespace): a cable pulled."""
    subprocess.run(["ip", "netns", "exec", host, "ip", "link", "set", "eth0", state], check=True)


@pytest.mark.slow
@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_a_link_down_ends_a_fixed_job_naming_the_host(bed, controller):
    out = bed["tmp"] / f"link-{controller}"
    cmd = [TESTBED, "run", str(BIN / "hvdtrain"), "launch", "--no-preflight", "--ssh-alive", ALIVE, "--hosts",
           ",".join(f"{h}:1" for h in HOSTS), "--controller", controller, "--", str(BIN / "python"), SLOW, "0.02",
           *SLOW_TRAIN, "--out", str(out)]
    proc = subprocess.Popen(cmd, env=bed["env"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        wait_for_step(out, 20, proc, 180)
        link(HOSTS[2], "down")
        cut = time.monotonic()
        text, _ = finish(proc, 150, "the job after the link went down")
        ended = time.monotonic() - cut
    finally:
        link(HOSTS[2], "up")
    print(f"{controller}: ended {ended:.1f} s after the link went down")
    assert proc.returncode != 0, text[-3000:]
    assert f"hvdtrain: launch: host {HOSTS[2]} does not answer over ssh" in text, text[-3000:]
    assert f"hvdtrain: launch: host {HOSTS[1]} does not answer" not in text
    # the effects, which name no host, give way to the cause
    assert "hvdtrain: launch: rank" not in text and "ORTE was unable" not in text, text[-3000:]


def world_sizes(out: Path) -> list[int]:
    """World size of each step record, in the order written (a step replayed after a rollback is
    written again)."""
    path = out / "samples.jsonl"
    lines = path.read_text().split("\n")[:-1] if path.exists() else []
    return [json.loads(line)["world_size"] for line in lines]


def regrown(sizes: list[int]) -> bool:
    return 2 in sizes and 3 in sizes[sizes.index(2):]


def wait_for(what: str, ok, proc: subprocess.Popen, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ok():
            return time.monotonic()
        assert proc.poll() is None, f"ended while waiting for {what}:\n{proc.stdout.read()[-3000:]}"
        time.sleep(0.1)
    raise AssertionError(f"no {what} within {timeout} s")


@pytest.mark.slow
def test_a_link_down_drops_the_host_from_an_elastic_job_and_it_rejoins_when_back(bed):
    # A real failure, not a graceful removal: the host stays in the discovery's list all along.
    hosts, out = bed["tmp"] / "elastic-hosts", bed["tmp"] / "link-elastic"
    hosts.write_text("".join(f"{h}:1\n" for h in HOSTS))
    cmd = [TESTBED, "run", str(BIN / "hvdtrain"), "launch", "--no-preflight", "--ssh-alive", ALIVE,
           "--host-discovery-script",
           f"{ROOT / 'scripts' / 'discover_hosts.sh'} {hosts}", "--min-np", "2", "--max-np", "3",
           "--blacklist-cooldown", "1", "2", "--", str(BIN / "python"), SLOW, "0.05", *SLOW_TRAIN, "--set",
           "train.max_steps=400", "--set", "elastic.enabled=true", "--set", "elastic.trace_samples=true",
           "--set", "elastic.commit_every=4", "--out", str(out)]
    proc = subprocess.Popen(cmd, env=bed["env"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        wait_for("step 10 at 3 ranks", lambda: len(world_sizes(out)) >= 10, proc, 180)
        link(HOSTS[2], "down")
        cut = time.monotonic()
        try:
            shrunk = wait_for("a step at 2 ranks", lambda: 2 in world_sizes(out), proc, 150)
        finally:
            link(HOSTS[2], "up")
        back = time.monotonic()
        grown = wait_for("a step at 3 ranks again", lambda: regrown(world_sizes(out)), proc, 150)
        text, _ = finish(proc, 300, "the elastic job after the host came back")
    except BaseException:
        os.killpg(proc.pid, 9)
        raise
    print(f"elastic: first step at 2 ranks {shrunk - cut:.1f} s after the link went down, "
          f"at 3 ranks again {grown - back:.1f} s after it came back")
    assert proc.returncode == 0, text[-3000:]
    steps = [json.loads(line)["step"] for line in (out / "samples.jsonl").read_text().splitlines()]
    sizes = world_sizes(out)
    assert sorted(set(steps)) == list(range(1, 401)) and sizes[0] == sizes[-1] == 3 and regrown(sizes), sizes
