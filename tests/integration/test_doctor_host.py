"""`hvdtrain doctor` and `hvdtrain launch`'s preflight on this host, with a stub libcuda planted on
the library path and /dev/shm made as small as Docker's default (64 MiB) in a mount namespace of the
test's own: each problem is one line naming the host, and launch starts nothing."""

import os
import shutil
import socket
import subprocess

import pytest
from launch import BIN, env, run

# The CUDA toolkit's stub answers cuInit with CUDA_ERROR_STUB_LIBRARY (34); this one does the same.
STUB_C = "int cuInit(unsigned int flags) { return 34; }\nint cuDriverGetVersion(int *v) { *v = 13000; return 0; }\n"


def _why_not() -> str | None:
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return "needs root and unshare (a private mount namespace for a 64 MiB /dev/shm)"
    if not shutil.which("gcc"):
        return "needs gcc to build the planted stub libcuda"
    return None


@pytest.fixture
def planted(tmp_path):
    """(environment with a stub libcuda first on LD_LIBRARY_PATH, command prefix with a 64 MiB /dev/shm)."""
    stubs = tmp_path / "cuda" / "lib64" / "stubs"
    stubs.mkdir(parents=True)
    (tmp_path / "stub.c").write_text(STUB_C)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(stubs / "libcuda.so.1"), str(tmp_path / "stub.c")], check=True)
    small_shm = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                 'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$@"', "sh"]
    return env(LD_LIBRARY_PATH=str(stubs)), small_shm, str(stubs / "libcuda.so.1")


@pytest.mark.skipif(_why_not() is not None, reason=_why_not() or "")
def test_doctor_reports_a_planted_stub_libcuda_and_a_small_dev_shm(planted):
    environ, small_shm, stub = planted
    out = run([*small_shm, str(BIN / "hvdtrain"), "doctor"], env=environ, check=False, split=True, timeout=60)
    assert out.returncode == 1, out.stdout + out.stderr
    host = socket.gethostname()
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"hvdtrain: doctor: host {host}: a stub libcuda.so.1 is what loads ({stub})")
    assert lines[1] == (f"hvdtrain: doctor: host {host}: /dev/shm is 64 MiB; NCCL and Open MPI's shared-memory "
                        "transport need more: run containers with --shm-size=1g (or --ipc=host)")
    assert f"{host}: libcuda.so.1: {stub} (a stub)" in out.stdout and f"{host}: /dev/shm: 64 MiB" in out.stdout
    # Without the plant, this host has nothing to report.
    assert run([str(BIN / "hvdtrain"), "doctor"], timeout=60).returncode == 0


@pytest.mark.skipif(_why_not() is not None, reason=_why_not() or "")
def test_launch_preflight_reports_them_per_host_and_starts_nothing(planted, tmp_path):
    environ, small_shm, stub = planted
    marker = tmp_path / "started"
    out = run([*small_shm, str(BIN / "hvdtrain"), "launch", "--hosts", "localhost:1", "--", "touch", str(marker)],
              env=environ, check=False, split=True, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    problems = [line for line in out.stderr.splitlines() if line.startswith("hvdtrain: preflight: host localhost: ")]
    assert any(f"a stub libcuda.so.1 is what loads ({stub})" in line for line in problems), out.stderr
    assert any("/dev/shm is 64 MiB" in line for line in problems), out.stderr
    assert "nothing was started" in out.stderr and not marker.exists()
