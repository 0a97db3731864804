"""Runs tests/distributed under horovodrun -np 2 with each controller; each rank runs the same tests
in the same order, and per-test timeouts inside plus a hard timeout outside turn a hang into a fast
failure that shows every rank's last lines."""

import re

import pytest
from launch import horovodrun


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_distributed_tests_pass_on_two_ranks(controller):
    out = horovodrun(["python", "-m", "pytest", "tests/distributed", "-q", "-p", "no:cacheprovider",
                      "-o", "timeout=90", "--color=no"], np=2, controller=controller, timeout=420).stdout
    # One pytest summary per rank, found by horovodrun's rank prefix: under MPI the two ranks' last
    # lines can land on one output line, so counting lines would miss one.
    summaries = dict(re.findall(r"\[(?:\d+,)?(\d+)\]<stdout>:([^\[\n]* passed[^\[\n]* in [\d.]+s)", out))
    assert sorted(summaries) == ["0", "1"], out[-3000:]
    assert all("failed" not in s and "error" not in s for s in summaries.values()), out[-3000:]
