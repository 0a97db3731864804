"""scripts/gpu_check.sh: one valid JSON line per check. Here (no GPU) the CPU-safe checks run and
pass and every GPU check is a skip with its reason. The build half (marker `cuda`: GBs of CUDA
wheels) makes the carried .device/ folder: a Horovod wheel for the GPU machine's Python 3.12 and
torch 2.11.0 with NCCL, and the working tree with it stays under the device tool's 64 MB."""

import json
import os
import subprocess
import zipfile

import pytest
from launch import ROOT, env, run

from hvdtrain.tools.gpu_check import CHECKS, GPU_CHECKS

SCRIPT = str(ROOT / "scripts" / "gpu_check.sh")
CPU_SAFE = set(CHECKS) - GPU_CHECKS


def parse(stdout: str) -> dict[str, dict]:
    lines = [json.loads(line) for line in stdout.splitlines() if line.strip()]  # stdout: JSON lines only
    for line in lines:
        assert set(line) >= {"check", "status", "reason"} and list(line)[:2] == ["check", "status"], line
        assert line["status"] in {"pass", "fail", "skip"}, line
        if line["status"] != "pass":
            assert line["reason"], f"{line['check']}: a {line['status']} needs a reason"
    checks = {line["check"]: line for line in lines}
    assert len(checks) == len(lines), "a check was reported twice"
    return checks


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cpu_safe_checks_pass_and_gpu_checks_skip_with_reasons():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this test describes a machine without a GPU; on a GPU host run scripts/gpu_check.sh itself")
    out = run([SCRIPT], timeout=540, check=False, split=True)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    checks = parse(out.stdout)
    assert set(checks) == set(CHECKS)
    for name in CPU_SAFE:
        assert checks[name]["status"] == "pass", checks[name]
    for name in GPU_CHECKS:
        assert checks[name]["status"] == "skip" and checks[name]["reason"].startswith("no CUDA GPU"), checks[name]
    # The GPU checks that have a CPU variant ran it: the codecs over Gloo on CPU tensors.
    codecs = checks["codecs"]
    assert codecs["device"] == "cpu" and codecs["rel_error"]["none"] == 0 and codecs["rel_error"]["fp16"] < 2**-10
    assert 0.9 < codecs["error_feedback_carried"] < 1.1
    assert checks["zero_checkpoint"]["resumed_diff"] < 1e-5
    assert checks["activation_checkpointing"]["ratio"] < 0.7
    assert checks["amp"]["fp16_skipped"] >= 1  # the overflowing steps were skipped, then steps taken


def test_a_failing_check_is_one_line_and_a_non_zero_exit(tmp_path):
    # A checkpoint folder that is a file: the ZeRO check fails, and says why, as one JSON line.
    blocker = tmp_path / "zero-ckpt"
    blocker.write_text("not a folder")
    out = run([SCRIPT, "--only", "horovod_build,zero_checkpoint", "--work", str(tmp_path)], timeout=300,
              check=False, split=True)
    checks = parse(out.stdout)
    assert out.returncode == 1 and checks["horovod_build"]["status"] == "pass"
    assert checks["zero_checkpoint"]["status"] == "fail" and checks["zero_checkpoint"]["reason"]


def tree_bytes() -> int:
    """What the device tool sends: tracked files and untracked ones git does not ignore."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    return sum(os.path.getsize(ROOT / f) for f in files if f and (ROOT / f).is_file())


@pytest.mark.cuda
@pytest.mark.timeout(3600)
def test_build_half_makes_the_device_wheel_and_the_carry_fits():
    run([SCRIPT, "build"], timeout=3500, env=env())
    carry = ROOT / ".device"
    manifest = json.loads((carry / "manifest.json").read_text())
    assert manifest["python"] == "3.12" and manifest["torch"].split("+")[0] == "2.11.0" and manifest["cuda"] == "13.0"
    (wheel,) = (carry / "wheels").glob("horovod-0.28.1-cp312-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("horovod/torch/mpi_lib_v2") for n in names)
    assert "-nompi-cu130-sm90" in manifest["horovod_key"]  # Gloo + NCCL, kernels for H100/H200
    assert list((carry / "build").glob("horovod-0.28.1.tar.gz")) and list((carry / "build").glob("cffi-*.whl"))
    carried = sum(p.stat().st_size for p in carry.rglob("*") if p.is_file())
    print(f"carry: {carried / 2**20:.1f} MiB in .device, tree {tree_bytes() / 2**20:.1f} MiB")
    assert carried + tree_bytes() < 64 * 2**20
