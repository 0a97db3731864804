"""examples/: the cluster launch files parse and say what their launchers need (one process; the
checks against the built image are in tests/integration/test_docker.py)."""

import re
import subprocess

from helpers import EXAMPLES, mpijob, sbatch_lines


def test_mpijob_is_a_v2beta1_job_with_a_launcher_and_gpu_workers():
    job = mpijob()
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v2beta1", "MPIJob")
    spec = job["spec"]
    assert spec["launcherCreationPolicy"] == "WaitForWorkersReady"  # worker names resolve only when ready
    assert spec["mpiImplementation"] == "OpenMPI"
    launcher, worker = spec["mpiReplicaSpecs"]["Launcher"], spec["mpiReplicaSpecs"]["Worker"]
    assert launcher["replicas"] == 1 and worker["replicas"] >= 1
    (w,) = worker["template"]["spec"]["containers"]
    assert w["resources"]["limits"]["nvidia.com/gpu"] == spec["slotsPerWorker"]  # one rank per GPU
    shm = {m["name"]: m["mountPath"] for m in w["volumeMounts"]}["dshm"]
    volume = {v["name"]: v for v in worker["template"]["spec"]["volumes"]}["dshm"]
    assert shm == "/dev/shm" and volume["emptyDir"]["medium"] == "Memory"  # NCCL: more than 64 MiB
    (la,) = launcher["template"]["spec"]["containers"]
    cmd = la["command"]
    assert cmd[:2] == ["hvdtrain", "launch"] and cmd[cmd.index("--hostfile") + 1] == "/etc/mpi/hostfile"
    assert cmd[cmd.index("--ssh-port") + 1] == str(w["ports"][0]["containerPort"])
    for c in (la, w):
        assert {"name": "NCCL_SOCKET_IFNAME", "value": "eth0"} in c["env"]


def test_slurm_scripts_start_ranks_through_pmix_one_per_gpu():
    for name in ("slurm-pyxis.sbatch", "apptainer.sbatch"):
        lines = sbatch_lines(name)
        opts = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", "\n".join(lines), re.M))
        assert opts["ntasks-per-node"] == opts["gpus-per-node"], name
        text = (EXAMPLES / name).read_text()
        # srun passes the signal to every rank (no B:); a stop exits 99 and the job is requeued.
        assert "#SBATCH --signal=USR1@90" in text and "#SBATCH --requeue" in text, name
        assert 'if [ "$rc" -eq 99 ]; then scontrol requeue "$SLURM_JOB_ID"' in text, name
        (srun,) = [line for line in lines if line.startswith("srun ")]
        assert "--mpi=pmix" in srun and "hvdtrain train" in srun and "--resume auto" in srun, name
        assert subprocess.run(["bash", "-n", str(EXAMPLES / name)]).returncode == 0
    pyxis = " ".join(sbatch_lines("slurm-pyxis.sbatch"))
    assert "--container-image=" in pyxis and "--container-mounts=" in pyxis
    apptainer = " ".join(sbatch_lines("apptainer.sbatch"))
    assert re.search(r"apptainer exec --nv\b", apptainer)


def test_the_ssh_slurm_script_takes_its_signal_in_the_batch_shell_and_requeues_on_exit_99():
    # How it behaves is tested end to end in tests/integration/test_preemption.py.
    text = (EXAMPLES / "slurm.sbatch").read_text()
    assert "#SBATCH --signal=B:USR1@90" in text and "#SBATCH --requeue" in text
    assert "trap 'kill -USR1 \"$launcher\"' USR1" in text and '--resume auto' in text
    assert subprocess.run(["bash", "-n", str(EXAMPLES / "slurm.sbatch")]).returncode == 0
