"""The failure summary's root-cause ordering (tandem/launch/failures.py), on records as the agents write them."""

import io
import signal

from rich.console import Console

from tandem.launch import failures as fl
from tandem.launch.failures import Failure

PEER = "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1"


def fail(rank, t, message="RuntimeError: boom", exitcode=1, node=0, traceback=""):
    return Failure(rank=rank, local_rank=rank % 2, node=node, host="h", exitcode=exitcode, pid=100 + rank,
                   time_ns=t, message=message, traceback=traceback, error_file="", log_file=f"rank-{rank}.err.log")


def test_earliest_own_error_is_the_root_cause():
    fs = [fail(0, 300), fail(3, 100, node=1), fail(1, 200)]
    assert fl.root_cause(fs).rank == 3


def test_a_lost_peer_ranks_after_any_own_error_even_when_earlier():
    """gloo's 'Connection closed by peer' on the survivors is a consequence: it can be written
    before the dead rank's own record (its agent saw the signal later)."""
    fs = [fail(0, 100, PEER), fail(1, 900, "RuntimeError: rank 1 was told to fail"), fail(2, 50, PEER)]
    assert fl.root_cause(fs).rank == 1
    # the traceback counts too: a peer loss mentioned only there is still a consequence
    fs2 = [fail(0, 100, "RuntimeError: collective failed", traceback="... Connection reset by peer ..."),
           fail(1, 900)]
    assert fl.root_cause(fs2).rank == 1


def test_a_rank_stopped_by_the_agent_ranks_after_one_that_failed_on_its_own():
    """torchrun SIGTERMs the other workers once one fails; the stopped rank's time is a whole-second timestamp
    that can be earlier than the real first failure's error file (EADDRINUSE on rank 0 in a doc-test run)."""
    fs = [fail(1, 1_000_000_000, "Signal 15 (SIGTERM) received by PID 101", exitcode=-signal.SIGTERM),
          fail(0, 1_400_000_000, "RuntimeError: The server socket has failed to listen on any local network "
                                 "address. port: 29500, useIpv6: false, code: -98, name: EADDRINUSE")]
    assert fl.root_cause(fs).rank == 0
    # a rank SIGKILLed on its own (the OOM killer), with only peer losses after it, is still the root cause
    assert fl.root_cause([fail(2, 500, PEER), fail(3, 900, "", exitcode=-signal.SIGKILL)]).rank == 3


def test_only_peer_losses_then_the_earliest_and_ties_by_rank():
    assert fl.root_cause([fail(2, 300, PEER), fail(1, 200, PEER), fail(0, 200, PEER)]).rank == 0
    assert fl.root_cause([fail(5, 7), fail(4, 7)]).rank == 4
    assert fl.root_cause([]) is None


def test_summary_and_table_name_the_root_cause_first():
    killed = fail(2, 500, message="<NONE>", exitcode=-signal.SIGKILL, node=1)
    fs = [fail(0, 100, PEER), killed, fail(1, 120, PEER)]
    text = fl.summarize(fs)
    assert text.startswith("rank 2 (node 1, local rank 0, host h) failed first with signal 9 (SIGKILL); "), text
    assert "3 rank(s) failed in all; log: rank-2.err.log" in text
    buf = io.StringIO()
    fl.render(fs, Console(file=buf, width=200))
    rows = [line for line in buf.getvalue().splitlines() if line.startswith("│")]
    assert [r.split("│")[1].strip() for r in rows] == ["2", "0", "1"], rows  # root cause, then by time
    assert "root cause" in rows[0] and "SIGKILL" in rows[0]


def test_records_round_trip_through_the_nodes_files(tmp_path):
    fl.write_node_failures(tmp_path, 1, [fail(3, 10, node=1)])
    fl.write_node_failures(tmp_path, 0, [fail(0, 20, PEER)])
    back = fl.read_failures(tmp_path)
    assert sorted(f.rank for f in back) == [0, 3] and fl.root_cause(back).rank == 3
