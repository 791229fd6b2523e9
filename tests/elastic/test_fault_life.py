"""A run's life from outside: kill -9 of `tandem train` leaves no worker behind, a run dir in
use refuses a second job, a rerun appends to the history, a second Ctrl-C stops at once, and
a dead peer never makes a survivor wait for a step it cannot agree on."""

import json
import os
import signal
from pathlib import Path

import pytest

from tandem.core import rundir
from elastic.fault_helpers import finish, heartbeat, processes_with, records, start_train, wait_for, write_spec

pytestmark = [pytest.mark.slow]


def _log_has(path: Path, text: str):
    return path.is_file() and text in path.read_text(errors="replace")


def test_kill_9_of_tandem_train_leaves_no_orphan_and_the_rerun_takes_the_lock_and_appends(tmp_path):
    run = tmp_path / "run"
    spec = write_spec(tmp_path / "job.toml", run, every=5)
    slow = {"TANDEM_FAULTS": "slow:rank=0:ms=150"}  # the job outlives the second start below
    proc = start_train(spec, env=slow)
    wait_for(lambda: (h := heartbeat(run, 1)) and h["step"] >= 6, timeout=180, what="step 6", interval=0.01)
    # a second job in the same run dir, while the first one's workers train: refused, nothing touched
    rc, out, err = finish(start_train(spec), timeout=120)
    assert rc == 2, err[-2000:]
    assert f"error: launch.run_dir: the run dir is in use by a live `tandem train` (pid {proc.pid} on" in err
    assert heartbeat(run, 1)["step"] < 45, "the first job finished before the check: not a test"
    workers = [heartbeat(run, r)["pid"] for r in (0, 1)]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    wait_for(lambda: not processes_with(str(run)), timeout=60, what="the workers to die with their parent")
    assert all(not Path(f"/proc/{p}/cmdline").is_file() or not Path(f"/proc/{p}/cmdline").read_bytes()
               for p in workers)
    before = rundir.read_metrics(run, all_attempts=True)
    assert before[0]["kind"] == "attempt" and [r for r in before if r["kind"] == "step"]
    first_log = (run / "logs" / "rank-0.log").read_text()
    # the owner was killed: its lock is stale, and the rerun takes it over and resumes
    rc, out, err = finish(start_train(spec))
    assert rc == 0, err[-3000:]
    text = " ".join((out + err).split())
    assert f"run dir lock {run / '.lock'}: its owner, pid {proc.pid} on" in text and "taking it over" in text
    every = rundir.read_metrics(run, all_attempts=True)
    assert every[:len(before)] == before  # appended, not rewritten
    assert [r["attempt"] for r in every if r["kind"] == "attempt"] == [1, 2]
    assert (run / "logs" / "rank-0.log").read_text() == first_log  # the first start's log, whole
    assert _log_has(run / "logs" / "rank-0.attempt2.log", "resumed from")
    start = records(run, "start")  # readers see this attempt
    assert len(start) == 1 and start[0]["start_step"] in (5, 10, 15, 20, 25, 30, 35, 40)
    assert json.loads(out)["step"] == 45 and not (run / ".lock").exists()


def test_kill_9_of_tandem_train_with_simulated_nodes_leaves_no_orphan(tmp_path):
    run = tmp_path / "run"
    spec = write_spec(tmp_path / "job.toml", run, nproc=1, every=0)
    proc = start_train(spec, "--launch.simulate_nodes", "2", env={"TANDEM_FAULTS": "slow:rank=0:ms=150"})
    wait_for(lambda: (h := heartbeat(run, 1)) and h["step"] >= 3, timeout=180, what="step 3", interval=0.01)
    assert len(processes_with(str(run))) >= 4  # 2 node agents (their config is in the run dir) + 2 workers
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    wait_for(lambda: not processes_with(str(run)), timeout=60, what="the agents and workers to die")


@pytest.mark.parametrize("nodes", [0, 2], ids=["one-node", "2-simulated-nodes"])
def test_a_second_ctrl_c_stops_at_once_without_a_checkpoint(tmp_path, nodes):
    """The first Ctrl-C asks for a checkpoint at an agreed step; the second, before it comes,
    stops every worker at once: exit 130, no checkpoint, no stop record, no process left."""
    run = tmp_path / "run"
    spec = write_spec(tmp_path / "job.toml", run, every=0, nproc=1 if nodes else 2)
    extra = ("--launch.simulate_nodes", str(nodes)) if nodes else ()
    # slow steps: the agreed step (1-2 steps after the first Ctrl-C) is seconds away
    proc = start_train(spec, "--checkpoint.at_end", "false", *extra, env={"TANDEM_FAULTS": "slow:rank=0:ms=500"},
                       own_group=True)
    wait_for(lambda: (h := heartbeat(run, 0)) and h["step"] >= 2, timeout=180, what="step 2", interval=0.01)
    os.killpg(proc.pid, signal.SIGINT)
    wait_for(lambda: _log_has(run / "logs" / "rank-0.err.log", "SIGINT received"), timeout=60,
             what="the workers to get the first Ctrl-C")
    os.killpg(proc.pid, signal.SIGINT)
    rc, out, err = finish(proc)
    assert rc == 130, err[-3000:]
    lines = [" ".join(l.split()) for l in err.splitlines() if l.startswith("error:")]
    assert lines == ["error: stopped by SIGINT. Fix: no checkpoint was saved: run the same command again to start "
                     "over"], err[-2000:]
    assert _log_has(run / "logs" / "rank-0.err.log", "SIGINT again: stopping at once, without a checkpoint")
    assert records(run, "stop") == [] and not list((run / "checkpoints").glob("step-*"))
    wait_for(lambda: not processes_with(str(run)), timeout=60, what="the workers to die with the job")


def test_a_dead_peer_skips_the_wait_for_an_agreed_step(tmp_path):
    """Rank 0 is busy outside any collective (a long data wait, say) when rank 1 is SIGKILLed:
    the agent stops rank 0 with SIGTERM, as for a user's stop. Rank 0 must not wait
    term_grace_s (10 s) for a step its dead peer can never agree on: it exits at once, saves
    nothing, and the restarted group trains on."""
    run = tmp_path / "run"
    spec = write_spec(tmp_path / "job.toml", run, every=5, max_steps=12)
    proc = start_train(spec, "--launch.max_restarts", "1", env={"TANDEM_FAULTS": "hang:rank=0:step=6:s=600"})
    wait_for(lambda: _log_has(run / "logs" / "rank-0.log", "fault injection: hang on rank 0"), timeout=180,
             what="rank 0 to hang")
    victim = heartbeat(run, 1)
    os.kill(victim["pid"], signal.SIGKILL)
    rc, out, err = finish(proc)
    assert rc == 0, err[-3000:]
    log = (run / "logs" / "rank-0.err.log").read_text(errors="replace")
    assert f"SIGTERM: rank 1 (pid {victim['pid']}) is gone; no step can be agreed, exiting at once" in log, log[-2000:]
    assert "no progress for" not in log
    assert records(run, "stop") == []  # no save-on-stop was attempted
    (restart,) = records(run, "restart")
    assert restart["resumed_step"] == 5 and json.loads(out)["step"] == 12
    print(f"\nrestart after a dead peer: {restart}")
