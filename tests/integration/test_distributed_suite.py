"""Runs tests/distributed under horovodrun -np 2 with each controller; each rank runs the same tests
in the same order, and per-test timeouts inside plus a hard timeout outside turn a hang into a fast
failure that shows every rank's last lines."""

import pytest
from launch import horovodrun


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_distributed_tests_pass_on_two_ranks(controller):
    out = horovodrun(["python", "-m", "pytest", "tests/distributed", "-q", "-p", "no:cacheprovider",
                      "-o", "timeout=90", "--color=no"], np=2, controller=controller, timeout=420).stdout
    summaries = [line for line in out.splitlines() if " passed" in line and " in " in line]
    assert len(summaries) == 2, out[-3000:]  # one pytest summary per rank
    assert all("failed" not in s and "error" not in s for s in summaries), out[-3000:]
