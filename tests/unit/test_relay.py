"""How `hvdtrain launch` reads horovodrun's output (hvdtrain/tools/relay.py): the exits it reports,
and the one line that replaces horovodrun's own traceback. The texts are horovodrun 0.28.1's, as
printed in tests/integration/test_faults.py and test_elastic.py runs."""

# ruff: noqa: E501 - horovodrun's lines, verbatim

import io
import subprocess

from hvdtrain.tools.hosts import Host
from hvdtrain.tools.relay import Exits, _copy, clean, keepalive_ssh, summary, unreachable

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


# mpirun when a host's ssh session (its orted) ended: tests/integration/test_multihost.py's link-down run.
MPI_DAEMON_LOST = """[1,0]<stdout>:hvdtrain: 3 rank(s), global batch 96, 800 steps, lr x3 (linear)
--------------------------------------------------------------------------
ORTE was unable to reliably start one or more daemons.
This usually is caused by:

* not finding the required libraries and/or binaries on
  one or more nodes. Please check your PATH and LD_LIBRARY_PATH
  settings, or configure OMPI with --enable-orterun-prefix-by-default

* lack of authority to execute on one or more specified nodes.
  Please verify your allocation and authorities.

* the inability to write startup files into /tmp (--tmpdir/orte_tmpdir_base).
  Please check with your sys admin to determine the correct location to use.

*  compilation of the orted with dynamic libraries when static are required
  (e.g., on Cray). Please check your configure cmd line and consider using
  one of the contrib/platform definitions for your system type.

* an inability to create a connection back to mpirun due to a
  lack of common network interfaces and/or no route found between
  them. Please check network connectivity (including firewalls
  and network routing requirements).
--------------------------------------------------------------------------
"""


def copied(text: str) -> tuple[str, Exits]:
    out, exits = io.StringIO(), Exits()
    _copy(io.StringIO(text), out, exits)
    return out.getvalue(), exits


def test_a_failed_gloo_run_keeps_the_ranks_lines_and_drops_horovodruns_traceback():
    out, exits = copied(GLOO_FAILED)
    assert "Traceback" not in out and "\nhvdtrain: rank 0: error" in out  # rank 0 speaks untagged
    assert "Process 1 exit with status code 3." in out
    assert exits.first == 1 and exits.codes[0] == 3
    assert summary(exits, 1, 99) == (
        "hvdtrain: launch: rank 1 exited first with code 3, and the other ranks were stopped; its lines above "
        "(tagged with its rank) say why. Fix that and rerun with --resume auto to continue from the last checkpoint")


def test_a_failed_mpi_run_names_the_rank_from_mpiruns_process_name():
    out, exits = copied(MPI_FAILED)
    assert out == MPI_FAILED.replace("[1,0]<stdout>:", "")  # no traceback to hold back
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
    for rc in (1, 0):  # horovodrun itself has exited 0 after its driver stopped the job (seen in CI)
        assert summary(exits, rc, 99).startswith(
            "hvdtrain: launch: fewer than --min-np 2 workers were left for 15 s (--elastic-timeout), so the elastic "
            "job stopped")


def test_any_other_failure_of_horovodrun_is_shown_whole():
    text = "Traceback (most recent call last):\n  File \"x\", line 1\nValueError: bad -H value\n"
    out, exits = copied(text)
    assert out == text and summary(exits, 1, 99) is None


def test_a_ranks_own_words_are_not_read_as_horovodruns():
    _, exits = copied("[0]<stdout>:my exit code: 7\n[0]<stdout>:Process name: 5\n")
    assert exits.codes == [] and exits.first is None


def test_open_mpis_lost_daemon_notice_is_held_back_for_the_launcher_to_judge():
    out, exits = copied(MPI_DAEMON_LOST + "[1,1]<stdout>:after\n")
    assert out == "hvdtrain: 3 rank(s), global batch 96, 800 steps, lr x3 (linear)\n[1,1]<stdout>:after\n"
    assert "".join(exits.daemon_lost) == MPI_DAEMON_LOST.split("\n", 1)[1]


def test_a_host_that_does_not_answer_over_ssh_is_named_and_local_ones_are_not_asked():
    hosts = [Host("localhost", 1), Host("no-such-host.invalid", 1)]
    lines = unreachable(hosts, [True, False], None)
    assert len(lines) == 1 and lines[0].startswith(
        "hvdtrain: launch: host no-such-host.invalid does not answer over ssh (ssh: Could not resolve hostname"), lines
    assert unreachable(hosts, [True, True], None) == []


def test_the_keepalive_ssh_asks_the_real_one_to_give_up_on_a_silent_host(tmp_path):
    ssh = tmp_path / keepalive_ssh(str(tmp_path), 30) / "ssh"
    config = subprocess.run([str(ssh), "-G", "somehost"], capture_output=True, text=True, check=True).stdout
    assert "serveraliveinterval 10" in config and "serveralivecountmax 3" in config


def test_rank_0_speaks_untagged_other_ranks_keep_their_tag_and_glued_tags_are_cut():
    # Open MPI tags each write; a line whose newline came in a second write carries a bare tag at its end.
    assert clean("[1,0]<stdout>:epoch 3/15 step 75: accuracy 0.9274[1,0]<stdout>:\n") == [
        "epoch 3/15 step 75: accuracy 0.9274\n"]
    assert clean("[0]<stderr>:hvdtrain: warning\n") == ["hvdtrain: warning\n"]
    assert clean("[1,1]<stdout>:rank one[1,1]<stdout>:\n") == ["[1,1]<stdout>:rank one\n"]
    assert clean("[1,0]<stdout>:a[1,1]<stdout>:b\n") == ["a\n", "[1,1]<stdout>:b\n"]
    assert clean("Process 1 exit with status code 3.\n") == ["Process 1 exit with status code 3.\n"]
    assert clean("[10]<stdout>:rank ten\n") == ["[10]<stdout>:rank ten\n"]
