"""scripts/install.sh's GPU branch, shown by its dry run (what docker/Dockerfile.gpu runs with HVDTRAIN_CUDA)."""

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def dry_run(tmp_path: Path, **knobs: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HVDTRAIN_")}
    # A venv and cache that do not exist: every step is shown (an existing venv would skip torch).
    env.update(HVDTRAIN_DRY_RUN="1", HVDTRAIN_VENV=str(tmp_path / "venv"), HVDTRAIN_CACHE=str(tmp_path / "cache"),
               HVDTRAIN_LOG_DIR=str(tmp_path / "logs"), **knobs)
    out = subprocess.run([str(ROOT / "scripts/install.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert not (tmp_path / "venv").exists() and not (tmp_path / "cache").exists(), "a dry run changed something"
    return out.stdout.splitlines()


def step(lines: list[str], name: str) -> str:
    hits = [line for line in lines if line.startswith(f"[dry-run] {name}")]
    assert len(hits) == 1, f"no single '{name}' step in:\n" + "\n".join(lines)
    return hits[0]


def test_gpu_branch_uses_cuda_torch_nccl_build_and_nccl_check(tmp_path):
    lines = dry_run(tmp_path, HVDTRAIN_CUDA="cu126")
    torch = step(lines, "install torch")
    assert re.search(r"pip install torch==2\.13\.0 --index-url https://download\.pytorch\.org/whl/cu126$", torch)
    build = step(lines, "build horovod wheel")
    for flag in ("HOROVOD_GPU_OPERATIONS=NCCL", "HOROVOD_WITH_GPU=1", "HOROVOD_WITH_PYTORCH=1",
                 "HOROVOD_WITH_MPI=1", "HOROVOD_WITH_GLOO=1"):
        assert f" {flag} " in build, flag
    assert "HOROVOD_WITHOUT_GPU" not in build and "--no-build-isolation" in build
    assert "CMAKE_CXX_STANDARD 17" in step(lines, "apply C++17 fix")
    # The wheel cache is keyed on the CUDA tag, so a CPU wheel is never installed on a GPU host.
    assert re.search(r"/cache/horovod-0\.28\.1r\d+-.*-cu126'/horovod-\*\.whl", step(lines, "install horovod wheel"))
    assert step(lines, "check:").endswith("shows PyTorch, MPI, Gloo, NCCL")


def test_cpu_branch_has_no_cuda_index_and_no_nccl(tmp_path):
    lines = dry_run(tmp_path)
    assert step(lines, "install torch").endswith("pip install torch==2.13.0")
    build = step(lines, "build horovod wheel")
    assert " HOROVOD_WITHOUT_GPU=1 " in build and "NCCL" not in build
    # Gloo's vectorised fp16 sum: without it an fp16 allreduce over Gloo is CPU-bound (install.sh).
    avx = step(lines, "enable Gloo's AVX fp16 sum")
    assert "set(USE_AVX ON)" in avx and "-DGLOO_USE_AVX=1" in avx and "gloo/math.cc" in avx
    assert step(lines, "check:").endswith("shows PyTorch, MPI, Gloo")


@pytest.mark.parametrize("cuda", ["cu126", ""])
def test_explicit_torch_index_wins(tmp_path, cuda):
    lines = dry_run(tmp_path, HVDTRAIN_CUDA=cuda, HVDTRAIN_TORCH_INDEX="https://mirror.example/whl")
    assert step(lines, "install torch").endswith("--index-url https://mirror.example/whl")


def test_cu130_comes_from_pypi_alone(tmp_path):
    # PyPI's Linux torch is the CUDA 13.0 build, NVIDIA's CUDA 13.0 toolchain is on PyPI as wheels,
    # and NCCL is torch's own nvidia-nccl-cu13: no other package source is needed.
    lines = dry_run(tmp_path, HVDTRAIN_CUDA="cu130")
    assert step(lines, "install torch").endswith("pip install torch==2.13.0")  # no --index-url
    toolchain = step(lines, "CUDA 13.0 toolchain from PyPI")
    assert f"--target {tmp_path}/cache/cuda-13.0" in toolchain
    for wheel in ("nvidia-cuda-nvcc==13.0", "nvidia-cuda-runtime==13.0", "nvidia-cuda-cccl==13.0",
                  "nvidia-cuda-crt==13.0", "nvidia-nvvm==13.0"):
        assert wheel in toolchain, wheel
    build = step(lines, "build horovod wheel")
    assert f" HOROVOD_CUDA_HOME={tmp_path}/cache/cuda-13.0/nvidia/cu13 " in build
    assert " HOROVOD_NCCL_INCLUDE=<venv>/nvidia/nccl/include " in build and " HOROVOD_NCCL_LINK=SHARED " in build
    assert " HOROVOD_BUILD_CUDA_CC_LIST=75,80,86,89,90,100,120 " in build  # CUDA 13 dropped sm_70 and older
    assert re.search(r"-cu130'/horovod-\*\.whl", step(lines, "install horovod wheel"))
    assert step(lines, "check:").endswith("shows PyTorch, MPI, Gloo, NCCL")


def test_a_cuda_12_tag_uses_pytorchs_index_and_the_machines_toolkit(tmp_path):
    lines = dry_run(tmp_path, HVDTRAIN_CUDA="cu128", HOROVOD_CUDA_HOME="/opt/cuda-12.8")
    assert step(lines, "install torch").endswith("--index-url https://download.pytorch.org/whl/cu128")
    assert not [line for line in lines if "toolchain from PyPI" in line]
    build = step(lines, "build horovod wheel")
    assert " HOROVOD_CUDA_HOME=/opt/cuda-12.8 " in build and "HOROVOD_NCCL_LINK" not in build


def test_without_mpi_builds_gloo_only(tmp_path):
    lines = dry_run(tmp_path, HVDTRAIN_CUDA="cu130", HVDTRAIN_WITHOUT_MPI="1")
    build = step(lines, "build horovod wheel")
    assert " HOROVOD_WITHOUT_MPI=1 " in build and "HOROVOD_WITH_MPI=1" not in build
    assert step(lines, "check:").endswith("shows PyTorch, Gloo, NCCL")
