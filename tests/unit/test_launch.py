"""hvdtrain launch and its host lists: Slurm list parsing, hostfiles, the horovodrun command and preflight verdicts."""

import argparse
import os

import pytest

from hvdtrain.tools import launch
from hvdtrain.tools.cli import main
from hvdtrain.tools.hosts import (
    Host,
    LaunchError,
    expand_nodelist,
    expand_tasks_per_node,
    hosts_from_slurm,
    parse_hosts,
    read_hostfile,
)


@pytest.mark.parametrize("text, names", [
    ("node01", ["node01"]),
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("a,b[1-2],c", ["a", "b1", "b2", "c"]),
    ("node[08-11]", ["node08", "node09", "node10", "node11"]),  # padding of the range start
    ("gpu[1-2]-ib", ["gpu1-ib", "gpu2-ib"]),
    ("r[1-2]-n[01-02]", ["r1-n01", "r1-n02", "r2-n01", "r2-n02"]),
    ("n[9-10],x[007]", ["n9", "n10", "x007"]),
])
def test_expand_nodelist(text, names):
    assert expand_nodelist(text) == names


@pytest.mark.parametrize("text", ["node[01-03", "node[3-1]", "node[a-b]", "a,,b", "n[[1]]"])
def test_bad_nodelist_is_one_clear_error(text):
    with pytest.raises(LaunchError, match="bad Slurm node list"):
        expand_nodelist(text)


@pytest.mark.parametrize("text, counts", [("2(x3),1", [2, 2, 2, 1]), ("4", [4]), ("1,2(x2)", [1, 2, 2])])
def test_expand_tasks_per_node(text, counts):
    assert expand_tasks_per_node(text) == counts


@pytest.mark.parametrize("text", ["2(x)", "0", "2x3", ""])
def test_bad_tasks_per_node(text):
    with pytest.raises(LaunchError, match="SLURM_TASKS_PER_NODE"):
        expand_tasks_per_node(text)


def test_hosts_from_slurm_uneven_tasks():
    env = {"SLURM_JOB_NODELIST": "node[01-03,07]", "SLURM_TASKS_PER_NODE": "2(x3),1"}
    assert hosts_from_slurm(env) == [Host("node01", 2), Host("node02", 2), Host("node03", 2), Host("node07", 1)]


def test_hosts_from_slurm_ntasks_per_node_and_default():
    env = {"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NTASKS_PER_NODE": "3"}
    assert hosts_from_slurm(env) == [Host("n1", 3), Host("n2", 3)]
    assert hosts_from_slurm({"SLURM_NODELIST": "n[1-2]"}) == [Host("n1", 1), Host("n2", 1)]


def test_hosts_from_slurm_mismatch_and_missing():
    with pytest.raises(LaunchError, match="3 nodes .* 2 task counts"):
        hosts_from_slurm({"SLURM_JOB_NODELIST": "n[1-3]", "SLURM_TASKS_PER_NODE": "2,1"})
    with pytest.raises(LaunchError, match="no host list"):
        hosts_from_slurm({})


def test_hostfile_and_hosts(tmp_path):
    f = tmp_path / "hosts"
    f.write_text("# cluster\nh1 slots=2\n\nh2   slots = 1  # gpu box\nh3\n")
    assert read_hostfile(f) == [Host("h1", 2), Host("h2", 1), Host("h3", 1)]
    assert parse_hosts("h1:2,h2") == [Host("h1", 2), Host("h2", 1)]
    f.write_text("h1 cpus=2\n")
    with pytest.raises(LaunchError, match="line 1"):
        read_hostfile(f)
    with pytest.raises(LaunchError, match="h1:x"):
        parse_hosts("h1:x")


def args(*argv):
    p = argparse.ArgumentParser()
    launch.add_arguments(p)
    return p.parse_args(list(argv))


def test_command_forces_ring_for_mpi_only():
    hosts = [Host("a", 2), Host("b", 1)]
    mpi = launch.build_command(args("--controller", "mpi", "--network-interface", "eth0", "--", "python", "t.py"),
                               hosts)
    assert mpi[1:] == ["-np", "3", "-H", "a:2,b:1", "--mpi", "--network-interface", "eth0",
                       f"--mpi-args={launch.MPI_RING_ARGS}", "python", "t.py"]
    assert "coll_tuned_allreduce_algorithm 4" in launch.MPI_RING_ARGS
    gloo = launch.build_command(args("-np", "2", "python", "t.py"), hosts)
    assert gloo[1:] == ["-np", "2", "-H", "a:2,b:1", "--gloo", "python", "t.py"]
    plain = launch.build_command(args("--controller", "mpi", "--mpi-allreduce", "default", "x"), hosts)
    assert not any(a.startswith("--mpi-args") for a in plain)
    extra = launch.build_command(args("--controller", "mpi", "--mpi-args=-x FOO", "x"), hosts)
    assert f"--mpi-args={launch.MPI_RING_ARGS} -x FOO" in extra


@pytest.mark.parametrize("argv, message", [
    (["--mpi-args=--mca btl tcp,self", "x"], "must not set 'btl'"),
    (["-np", "4", "x"], "more than the 3 slots"),
    (["--"], "no command"),
])
def test_command_errors(argv, message):
    with pytest.raises(LaunchError, match=message):
        launch.build_command(args(*argv), [Host("a", 2), Host("b", 1)])


def test_cli_dry_run_from_slurm(capsys, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[1-2]")
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "2(x2)")
    assert main(["launch", "--dry-run", "--", "hvdtrain", "train", "--task", "digits"]) == 0
    out = capsys.readouterr().out
    assert "-np 4 -H node1:2,node2:2 --gloo hvdtrain train --task digits" in out


def test_cli_np_alone_means_this_machine_and_inside_slurm_the_allocation(capsys, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)
    monkeypatch.delenv("SLURM_NODELIST", raising=False)
    assert main(["launch", "-np", "2", "--dry-run", "--", "hvdtrain", "train"]) == 0
    assert capsys.readouterr().out.strip().endswith("-np 2 -H localhost:2 --gloo hvdtrain train")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[1-2]")
    assert main(["launch", "-np", "2", "--dry-run", "--", "true"]) == 0
    assert capsys.readouterr().out.strip().endswith("-np 2 -H node1:1,node2:1 --gloo true")


def test_cli_error_is_one_line_exit_2(capsys, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)
    monkeypatch.delenv("SLURM_NODELIST", raising=False)
    assert main(["launch", "--", "true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["hvdtrain: error: no host list: pass --hosts or --hostfile, or run inside a Slurm job "
                   "(SLURM_JOB_NODELIST)"]


REF = {"python": "3.11.2", "torch": "2.13.0", "horovod": "0.28.1", "hvdtrain": "/src/hvdtrain/__init__.py",
       "hostname": "n1", "ip": "10.0.0.1", "cwd": True, "nic": True, "nics": ["eth0", "lo"]}


def test_host_problems_each_one_line_naming_the_host():
    assert launch.host_problems("n1", REF, REF, "eth0", "gloo") == []
    bad = dict(REF, torch="2.12.0", horovod=None, hvdtrain="/other/hvdtrain/__init__.py", cwd=False, nic=False,
               ip="127.0.1.1")
    lines = launch.host_problems("n1", bad, REF, "ib0", "gloo")
    assert len(lines) == 6 and all(line.startswith("host n1: ") for line in lines)
    text = "\n".join(lines)
    for part in ("torch 2.12.0, launcher has 2.13.0", "Horovod missing", "/other/hvdtrain", "working directory",
                 "network interface ib0 not found (has: eth0, lo)", "resolves to loopback 127.0.1.1"):
        assert part in text
    # MPI does not use gethostname() for its transport: the loopback trap is Gloo's only.
    assert len(launch.host_problems("n1", bad, REF, "ib0", "mpi")) == 5
    # Nor does it matter to a run on one host: its ranks meet on loopback.
    assert len(launch.host_problems("n1", bad, REF, "ib0", "gloo", alone=True)) == 5
    assert launch.host_problems("n2", {"error": "not reachable over ssh: timeout"}, REF, "", "gloo") == [
        "host n2: not reachable over ssh: timeout"]


def test_preflight_on_this_machine_passes_and_finds_a_missing_nic():
    local = [Host("localhost", 1)]
    assert launch.preflight(local, "", "mpi") == []
    lines = launch.preflight(local, "nonexistent0", "mpi")
    assert lines == [f"host localhost: network interface nonexistent0 not found (has: "
                     f"{', '.join(sorted(os.listdir('/sys/class/net')))})"]


def test_elastic_command_from_a_discovery_script(tmp_path, capsys, monkeypatch):
    hosts = tmp_path / "hosts"
    hosts.write_text("a:2\nb slots=1\n")
    script = f"{launch.__file__.rsplit('/hvdtrain/', 1)[0]}/scripts/discover_hosts.sh {hosts}"
    assert main(["launch", "--host-discovery-script", script, "--min-np", "2", "--blacklist-cooldown", "1", "5",
                 "--no-preflight", "--dry-run", "--", "hvdtrain", "train", "--elastic"]) == 0
    out = capsys.readouterr().out
    assert (f" -np 3 --min-np 2 --max-np 3 --host-discovery-script '{script}' --blacklist-cooldown-range 1 5 "
            "--gloo hvdtrain train --elastic") in out
