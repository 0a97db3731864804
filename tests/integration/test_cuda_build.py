"""The GPU stack built without a GPU, from PyPI alone (marker `cuda`: several GB of wheels).

    ./scripts/test.sh -m cuda

scripts/install.sh with HVDTRAIN_CUDA=cu130 takes PyPI's torch (its Linux build is the CUDA 13.0
one), assembles NVIDIA's CUDA 13.0 toolchain wheels into a CUDA home and builds Horovod with NCCL
GPU operations against torch's own NCCL wheel. The venv is kept in the wheel cache, so a second
run takes seconds."""

import os
import re
from pathlib import Path

import pytest
from launch import ROOT, env, run

CACHE = Path(os.environ.get("HVDTRAIN_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
             / "hvdtrain")


def cuda_venv(tmp_path: Path) -> Path:
    """A venv with the CUDA 13.0 builds of torch and Horovod (made once, then reused)."""
    venv = CACHE / "venv-cu130-py311"
    empty = tmp_path / "no-local-wheels"
    empty.mkdir()
    # pip's find-links may hold a local CPU wheel of the same torch version (2.13.0+cpu sorts after
    # 2.13.0): an empty folder in its place makes pip take PyPI's CUDA build. install.sh refuses a
    # torch that is not built for the CUDA the tag names, so a wrong pick fails loudly.
    run([str(ROOT / "scripts" / "install.sh")], timeout=3000,
        env=env(HVDTRAIN_CUDA="cu130", HVDTRAIN_VENV=str(venv), HVDTRAIN_LOG_DIR=str(tmp_path / "logs"),
                PIP_FIND_LINKS=str(empty)))
    return venv


@pytest.mark.cuda
@pytest.mark.timeout(3600)
def test_nccl_build_from_pypi_lists_nccl_and_a_cuda_build_still_trains_on_cpu(tmp_path):
    venv = cuda_venv(tmp_path)
    check = run([str(venv / "bin" / "horovodrun"), "--check-build"], timeout=120).stdout
    print(check)
    for framework in ("PyTorch", "MPI", "Gloo", "NCCL"):
        assert re.search(rf"\[X\] {framework}$", check, re.M), framework
    probe = "import torch; print(torch.version.cuda, torch.cuda.is_available())"
    cuda = run([str(venv / "bin" / "python"), "-c", probe], timeout=120).stdout.split()
    assert cuda == ["13.0", "False"]  # the CUDA build, on this machine without a GPU
    out = run([str(venv / "bin" / "horovodrun"), "-np", "2", "--gloo", str(venv / "bin" / "hvdtrain"), "train",
               "--config", "configs/digits.yaml", "--set", "train.epochs=4", "--set", "log.progress=false"],
              timeout=600, env=env(PATH=f"{venv / 'bin'}:{os.environ['PATH']}")).stdout
    m = re.search(r"done: step \d+, eval loss [\d.]+ accuracy ([\d.]+)", out)
    assert m and float(m.group(1)) >= 0.9, out[-3000:]


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_gpu_image_builds_from_the_local_base_and_trains_digits_inside_on_cpu(tmp_path):
    from conftest import build_args, podman, why_no_podman_build

    if why_no_podman_build():
        pytest.skip(why_no_podman_build())
    cuda_venv(tmp_path)  # fills the cache the build mounts: the same Horovod wheel, not a second compile
    run([str(ROOT / "scripts/container-base.sh")], timeout=600)
    tag = "localhost/hvdtrain:gpu-test"
    podman(*build_args("Dockerfile.gpu", tag), "--build-arg", "BASE_IMAGE=localhost/debian:bookworm", ".",
           timeout=3000)
    size = int(podman("image", "inspect", "--format", "{{.Size}}", tag).stdout.strip())
    print(f"GPU image: {size / 2**30:.2f} GiB")
    check = podman("run", "--rm", "--network", "none", tag, "horovodrun", "--check-build").stdout
    assert re.search(r"\[X\] NCCL$", check, re.M) and re.search(r"\[X\] MPI$", check, re.M), check
    doctor = podman("run", "--rm", "--network", "none", "--shm-size=1g", tag, check=False, split=True)
    assert doctor.returncode == 0 and "torch built for CUDA: 13.0" in doctor.stdout, doctor.stdout + doctor.stderr
    out = podman("run", "--rm", "--network", "none", tag, "horovodrun", "-np", "2", "hvdtrain", "train",
                 "--config", "configs/digits.yaml", "--set", "train.epochs=4", "--set", "log.progress=false",
                 timeout=600).stdout
    m = re.search(r"done: step \d+, eval loss [\d.]+ accuracy ([\d.]+)", out)
    assert m and float(m.group(1)) >= 0.9, out[-3000:]


@pytest.mark.cuda
@pytest.mark.timeout(1800)
def test_the_nvtx_recorder_sees_torchs_ranges_without_a_gpu(tmp_path):
    # gpu_check's NVTX check injects scripts/nvtx_recorder.c the way Nsight Systems attaches; NVTX
    # needs no GPU, so the CUDA build of torch shows here that the recorder sees what torch pushes.
    venv = cuda_venv(tmp_path)
    lib, log = tmp_path / "nvtx_recorder.so", tmp_path / "nvtx.log"
    run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(ROOT / "scripts" / "nvtx_recorder.c")], timeout=60)
    code = ("import torch\nwith torch.cuda.nvtx.range('forward'):\n    torch.cuda.nvtx.range_push('allreduce wait')\n"
            "    torch.cuda.nvtx.range_pop()\n")
    run([str(venv / "bin" / "python"), "-c", code], timeout=120,
        env=env(NVTX_INJECTION64_PATH=str(lib), HVDTRAIN_NVTX_LOG=str(log)))
    assert log.read_text().splitlines() == ["push forward", "push allreduce wait", "pop", "pop"]
