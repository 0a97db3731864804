"""scripts/gpu_check.sh: one valid JSON line per check; here (no GPU) the CPU-safe parts run and pass,
every GPU check is a skip with its reason, and a failing check makes the script exit non-zero."""

import json
import math
import subprocess

import pytest
from launch import ROOT, env, run

SCRIPT = str(ROOT / "scripts" / "gpu_check.sh")
GPU_CHECKS = {"nccl_ops", "gpu_pinning", "oom", "fp16_compression", "autocast_fp16", "autocast_bf16"}
ALL_CHECKS = GPU_CHECKS | {"environment", "horovod_build", "allreduce_busbw", "train_digits", "train_pylm"}


def gpu_check(timeout: float, **extra: str) -> subprocess.CompletedProcess:
    """Run the script with stdout (the JSON lines) and stderr (launcher output) kept apart."""
    return run([SCRIPT], timeout=timeout, check=False, split=True, env=env(**extra))


def parse(stdout: str) -> dict[str, dict]:
    lines = [json.loads(line) for line in stdout.splitlines() if line.strip()]  # stdout: JSON lines only
    for line in lines:
        assert set(line) >= {"check", "status", "reason"} and list(line)[:2] == ["check", "status"], line
        assert line["status"] in {"pass", "fail", "skip"}, line
        if line["status"] != "pass" or line["check"] == "environment":
            assert line["reason"], f"{line['check']}: a {line['status']} needs a reason"
    checks = {line["check"]: line for line in lines}
    assert len(checks) == len(lines), "a check was reported twice"
    return checks


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cpu_safe_parts_run_and_gpu_checks_skip_with_reasons():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this test describes a machine without a GPU; on a GPU host run scripts/gpu_check.sh itself")
    out = gpu_check(timeout=540)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    checks = parse(out.stdout)
    assert set(checks) == ALL_CHECKS
    for name in GPU_CHECKS:
        assert checks[name]["status"] == "skip", checks[name]
    assert "no CUDA GPU" in checks["nccl_ops"]["reason"] and "no CUDA GPU" in checks["gpu_pinning"]["reason"]
    assert "OOM check" in checks["oom"]["reason"]  # says which OOM check it would run
    comp = checks["fp16_compression"]
    if "not built yet" not in comp["reason"]:  # hvdtrain has compression: its codec ran over Gloo/MPI
        assert comp["device"] == "cpu" and comp["max_rel_error"] < 1e-2 and "NCCL not checked" in comp["reason"]
    build = checks["horovod_build"]
    assert build["status"] == "pass" and build["ranks"] == 2 and build["mpi"] and build["gloo"]
    bw = checks["allreduce_busbw"]
    assert bw["status"] == "pass" and bw["mib"] == 64 and bw["ranks"] == 2 and bw["time_ms"] > 0
    assert math.isclose(bw["busbw_gbps"], bw["algbw_gbps"] * 2 * (2 - 1) / 2, rel_tol=1e-2)
    assert math.isclose(bw["algbw_gbps"], 64 * 2**20 / (bw["time_ms"] / 1e3) / 1e9, rel_tol=1e-2)
    digits = checks["train_digits"]
    assert digits["status"] == "pass" and digits["device"] == "cpu" and digits["accuracy"] >= 0.85
    pylm = checks["train_pylm"]
    assert pylm["status"] == "pass" and pylm["steps"] == 5 and math.isfinite(pylm["eval_loss"])


@pytest.mark.timeout(300)
def test_a_failed_check_fails_the_script():
    # One second per launch: every horovodrun launch times out and is reported as a failed check.
    out = gpu_check(timeout=240, GPU_CHECK_TIMEOUT="1")
    checks = parse(out.stdout)
    assert out.returncode == 1, out.stdout
    failed = {name for name, line in checks.items() if line["status"] == "fail"}
    assert {"worker", "train_digits", "train_pylm"} <= failed
    assert all("timed out" in checks[name]["reason"] for name in failed)
    assert "check(s) failed" in out.stderr


def test_without_horovod_it_stops_with_one_line():
    out = gpu_check(timeout=60, HVDTRAIN_PYTHON="/usr/bin/false")
    assert out.returncode == 2 and out.stdout == "" and out.stderr.strip().count("\n") == 0
    assert "cannot import horovod.torch and hvdtrain" in out.stderr
