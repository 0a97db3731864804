"""How `hvdtrain launch` reads horovodrun's output (hvdtrain/tools/relay.py): the exits it reports,
and the one line that replaces horovodrun's own traceback. The texts are horovodrun 0.28.1's, as
printed in tests/integration/test_faults.py and test_elastic.py runs."""

# ruff: noqa: E501 - horovodrun's lines, verbatim

import io

from hvdtrain.tools.relay import Exits, _copy, summary

GLOO_FAILED = """[0]<stdout>:hvdtrain: 2 rank(s), global batch 64, 25 steps, lr x2 (linear)
[0]<stderr>:hvdtrain: rank 0: error: another rank exited or lost its connection
Process 1 exit with status code 3.
Terminating remaining workers after failure of Process 1.
[0]<stderr>:Terminated
Process 0 exit with status code 143.
Traceback (most recent call last):
  File "/venv/bin/horovodrun", line 8, in <module>
    sys.exit(run_commandline())
  File "/venv/lib/python3.11/site-packages/horovod/runner/gloo_run.py", line 284, in launch_gloo
    raise RuntimeError('Horovod detected that one or more processes exited with non-zero '
RuntimeError: Horovod detected that one or more processes exited with non-zero status, thus causing the job to be terminated. The first process to do so was:
Process name: 1
Exit code: 3
"""

MPI_FAILED = """[1,0]<stdout>:hvdtrain: 2 rank(s), global batch 64, 25 steps, lr x2 (linear)
--------------------------------------------------------------------------
mpirun detected that one or more processes exited with non-zero status, thus causing
the job to be terminated. The first process to do so was:

  Process name: [[29979,1],1]
  Exit code:    3
--------------------------------------------------------------------------
"""

ELASTIC_TOO_FEW = """ERROR:root:failed to activate new hosts -> stop running
Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/horovod/runner/elastic/driver.py", line 178, in wait_for_available_slots
horovod.runner.common.util.timeout.TimeoutException: Timed out waiting for {activity}. Please check that you have enough resources to run at least 2 Horovod processes. Timeout after 15 seconds.
[1]<stderr>:Terminated
Process 1 exit with status code 143.
Exception occurred during processing of request from ('127.0.0.1', 51352)
Traceback (most recent call last):
BrokenPipeError: [Errno 32] Broken pipe
"""


def copied(text: str) -> tuple[str, Exits]:
    out, exits = io.StringIO(), Exits()
    _copy(io.StringIO(text), out, exits)
    return out.getvalue(), exits


def test_a_failed_gloo_run_keeps_the_ranks_lines_and_drops_horovodruns_traceback():
    out, exits = copied(GLOO_FAILED)
    assert "Traceback" not in out and "[0]<stderr>:hvdtrain: rank 0: error" in out
    assert "Process 1 exit with status code 3." in out
    assert exits.first == 1 and exits.codes[0] == 3
    assert summary(exits, 1, 99) == (
        "hvdtrain: launch: rank 1 exited first with code 3, and the other ranks were stopped; its lines above "
        "(tagged with its rank) say why. Fix that and rerun with --resume auto to continue from the last checkpoint")


def test_a_failed_mpi_run_names_the_rank_from_mpiruns_process_name():
    out, exits = copied(MPI_FAILED)
    assert out == MPI_FAILED  # no traceback to hold back
    assert exits.first == 1 and exits.codes == [3]
    assert summary(exits, 3, 99).startswith("hvdtrain: launch: rank 1 exited first with code 3")


def test_a_stopped_run_or_a_clean_one_needs_no_summary():
    _, exits = copied(GLOO_FAILED.replace("code 3", "code 99").replace("Exit code: 3", "Exit code: 99"))
    assert summary(exits, 1, 99) is None
    assert summary(Exits(), 0, 99) is None


def test_an_elastic_job_with_too_few_workers_ends_in_one_line():
    out, exits = copied(ELASTIC_TOO_FEW)
    assert "Traceback" not in out and "BrokenPipeError" not in out and "failed to activate new hosts" in out
    assert exits.too_few == (2, 15)
    assert summary(exits, 1, 99).startswith(
        "hvdtrain: launch: fewer than --min-np 2 workers were left for 15 s (--elastic-timeout), so the elastic "
        "job stopped")


def test_any_other_failure_of_horovodrun_is_shown_whole():
    text = "Traceback (most recent call last):\n  File \"x\", line 1\nValueError: bad -H value\n"
    out, exits = copied(text)
    assert out == text and summary(exits, 1, 99) is None


def test_a_ranks_own_words_are_not_read_as_horovodruns():
    _, exits = copied("[0]<stdout>:my exit code: 7\n[0]<stdout>:Process name: 5\n")
    assert exits.codes == [] and exits.first is None
