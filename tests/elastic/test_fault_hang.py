"""Hangs: the watchdog notices, dumps stacks (py-spy or faulthandler) and the last collectives
(torch's flight recorder), names the rank that stopped first, ends the group.

A trained run: SIGSTOP a worker, then an async save cut short by SIGKILL (checkpoints written
with dcp.async_save). Two bare gloo workers: a rank stopped or busy outside any collective
while its peer waits inside one, dumped with py-spy and with faulthandler."""

import json
from pathlib import Path

import pytest

from elastic.fault_helpers import assert_bitwise_equal, final_state, finish, records, start_train, write_spec
from tandem.launch import hangdump
from tandem.train import checkpoint as ckpt

T = 4  # watchdog limit in seconds


@pytest.mark.slow
def test_sigstop_detected_then_sigkill_during_async_save(reference, tmp_path):
    spec = write_spec(tmp_path / "job.toml", tmp_path / "run")
    faults = "sigstop:rank=1:step=15,sigkill:rank=1:async_save=30:attempt=1"
    rc, out, err = finish(start_train(spec, "--launch.max_restarts", "2", "--launch.watchdog_s", str(T),
                                      "--checkpoint.async_save", "true", env={"TANDEM_FAULTS": faults}))
    assert rc == 0, err[-3000:]
    run = tmp_path / "run"
    wd = run / "watchdog"
    hang = json.loads((wd / "hang-attempt0-node0.json").read_text())
    assert hang["first_stopped_rank"] == 1 and "stopped (state T" in hang["why"]
    assert hang["ranks"]["1"]["state"] == "T" and hang["ranks"]["1"]["step"] == 15
    latency = hang["detected_at"] - hang["ranks"]["1"]["last_beat"]
    # Never before T seconds of silence; that it fired while the hang lasted (not after the group
    # ended some other way) is the flight recorder's evidence below: rank 0 still waited inside a
    # collective rank 1 never entered. No upper clock bound: a busy host delays the watchdog's poll.
    assert T <= latency, latency
    stacks1 = Path(hang["stacks"]["1"]["file"]).read_text()
    stacks0 = Path(hang["stacks"]["0"]["file"]).read_text()
    assert "faults.py" in stacks1 and "trainer.py" in stacks1  # where it stopped
    assert "trainer.py" in stacks0  # where the other rank waited for it
    assert {s["tool"] for s in hang["stacks"].values()} == (
        {"py-spy dump --native", "py-spy dump --nonblocking"} if hangdump.pyspy_exe() else {"faulthandler"})
    # torch's flight recorder, read from both ranks: rank 0 waits in a collective rank 1 never entered
    groups = {r: hang["collectives"][r]["groups"] for r in ("0", "1")}
    assert groups["1"]["default_pg"]["entered"] < groups["0"]["default_pg"]["entered"]
    wait = next(w for w in hang["collective_waits"] if w.startswith("default_pg: "))
    assert wait.startswith("default_pg: rank(s) [0] wait in #") and "which rank(s) [1] never entered" in wait
    # the launcher's own lines (rich may wrap them); worker lines ([rankN]: ...) can land between
    # a wrapped line's parts on a busy host, so they are left out before the words are joined
    ours = " ".join(" ".join(ln for ln in err.splitlines() if not ln.lstrip().startswith("[rank")).split())
    assert "rank 1 stopped first" in err and f"Flight recorder: {wait}" in ours
    result = json.loads(out)
    hung, killed = result["restarts"]
    # step 10's async save is published before the hang at step 15 unless the host is so busy that
    # it is still in flight when the group is ended: then the restart resumes from step 0
    assert hung["detected_by"] == "watchdog" and hung["hang_first_rank"] == 1 and hung["resumed_step"] in (10, 0)
    assert killed["resumed_step"] == 20  # the async save of step 30 was never published
    assert all(r["lost_s"] < 60 for r in result["restarts"]), result["restarts"]
    assert records(run, "ckpt_cleaned")[0]["folders"] == [".tmp-step-00000030"]
    assert [p.name for p in ckpt.list_complete(run / "checkpoints")] == [
        "step-00000030", "step-00000040", "step-00000045"]
    saves = records(run, "ckpt")
    assert saves and all(s["mode"] == "async" and s["block_s"] <= s["save_s"] for s in saves)
    assert_bitwise_equal(final_state(result["checkpoint"]), reference["state"])
    print(f"\nwatchdog detection latency {latency:.2f} s (T = {T} s); restarts {result['restarts']}")
    print("async saves: " + ", ".join(f"step {s['step']} blocked {s['block_s'] * 1e3:.0f} ms of "
                                      f"{s['save_s'] * 1e3:.0f} ms" for s in saves))


WORKER = r'''
import os, signal, sys, time
import torch, torch.distributed as dist, torch.nn as nn
from tandem.launch import hangdump
from tandem.core.heartbeat import Heartbeat, read
rank, store, run, how = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
torch.manual_seed(0)
dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
assert hangdump.serve() is None
hb = Heartbeat(run, rank, rank)
m = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
for step in range(1, 4):
    hb.beat(step - 1, "sync")
    m(torch.randn(8, 4)).sum().backward()
    hb.beat(step, "step")
if rank == 1:
    if how == "sigstop":
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(600)  # "hang": running, in Python, outside any collective
while (read(os.path.join(run, "heartbeat", "rank-1.json")) or {}).get("step") != 3:
    time.sleep(0.01)  # rank 1's last beat must be the older one
hb.beat(3, "sync")
m(torch.randn(8, 4)).sum().backward()  # DDP's buffer broadcast waits for rank 1 forever
'''


# each case starts two workers (4-8 s on 2 cores): the quick subset keeps the one that needs no py-spy;
# the other three pairings run in the full suite
@pytest.mark.parametrize("tool, how", [pytest.param("py-spy", "hang", marks=pytest.mark.slow),
                                       pytest.param("py-spy", "sigstop", marks=pytest.mark.slow),
                                       pytest.param("faulthandler", "hang", marks=pytest.mark.slow),
                                       ("faulthandler", "sigstop")])
def test_hang_dump_names_first_rank_stacks_and_collectives(tmp_path, monkeypatch, how, tool):
    """Two real gloo workers: rank 1 stops (SIGSTOP) or sleeps outside any collective, rank 0
    waits in DDP's next collective. The watchdog's dump must show both."""
    import os
    import subprocess
    import sys
    import time

    from elastic.fault_helpers import wait_for
    from tandem.launch import hangdump
    from tandem.core.heartbeat import read
    from tandem.launch.watchdog import Watchdog, proc_state
    from tandem_testing import ROOT

    if tool == "py-spy" and hangdump.pyspy_exe() is None:
        pytest.skip("py-spy is not installed (pip install 'tandem[debug]'); the faulthandler case runs instead")
    monkeypatch.setenv(hangdump.STACKS_ENV, "py-spy" if tool == "py-spy" else "faulthandler")
    run = tmp_path / "run"
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(tmp_path / "store"), str(run), how],
                              env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        def rank0_waits():  # its last beat, then a collective in flight (for good: rank 1 is not there)
            if (read(run / "heartbeat" / "rank-0.json") or {}).get("step") != 3 or \
                    (read(run / "heartbeat" / "rank-0.json") or {}).get("phase") != "sync":
                return False
            fr = hangdump.flight_recorder(hangdump.Request(procs[0].pid, "fr_trace_json", timeout=5))
            return "entries" in fr and hangdump.summarize(fr)["groups"]["default_pg"]["pending"]
        wait_for(rank0_waits, 120, "rank 0 inside a collective rank 1 never joins", interval=0.2)
        if how == "sigstop":
            wait_for(lambda: proc_state(procs[1].pid) == "T", 10, "rank 1 stopped")
        dog = Watchdog(run, timeout_s=30)
        t = time.monotonic()
        path = dog.check(now=time.time() + 60)
        took = time.monotonic() - t
        assert path is not None
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=30)
    rep = json.loads(path.read_text())
    assert rep["first_stopped_rank"] == 1
    assert ("stopped (state T" if how == "sigstop" else "heartbeat is the oldest") in rep["why"]
    # the last collectives, from torch's flight recorder, on both ranks (a stopped one once continued)
    c0, c1 = rep["collectives"]["0"]["groups"]["default_pg"], rep["collectives"]["1"]["groups"]["default_pg"]
    assert c0["pending"][-1] == c0["newest"] and c0["newest"].split()[1] == "gloo:broadcast"  # DDP's buffers
    assert c1["entered"] < c0["entered"] and c1["newest"].split()[1] == "gloo:all_reduce"  # its last gradients
    (wait,) = rep["collective_waits"]
    first = next(p for p in c0["pending"] if p.startswith(f"#{c1['entered'] + 1} "))
    more = f" (and {c0['entered'] - c1['entered'] - 1} more after it)" if first != c0["newest"] else ""
    assert wait == (f"default_pg: rank(s) [0] wait in {first}{more}, which rank(s) [1] never entered "
                    f"(last entered: #{c1['entered']})")
    assert (run / "watchdog" / "fr-rank-0.attempt0.json").is_file()
    # stacks: where rank 1 stopped or sleeps, and rank 0 inside DDP's collective (native frames by py-spy)
    s0, s1 = rep["stacks"]["0"], rep["stacks"]["1"]
    if tool == "py-spy":  # a stopped process is read without suspending it: Python frames only
        assert s0["tool"] == "py-spy dump --native", s0
        assert s1["tool"] == ("py-spy dump --nonblocking" if how == "sigstop" else "py-spy dump --native"), s1
    else:
        assert s0["tool"] == s1["tool"] == "faulthandler"
    text0, text1 = Path(s0["file"]).read_text(), Path(s1["file"]).read_text()
    assert "worker.py" in text1 and "worker.py" in text0 and "distributed.py" in text0
    if tool == "py-spy":
        assert "c10d::" in text0  # the C++ frames of the wait, which faulthandler cannot see
        if how == "hang":
            assert "time_sleep" in text1 or "clock_nanosleep" in text1
    else:
        assert s0["why"] == f"{hangdump.STACKS_ENV}=faulthandler"
    assert not hangdump.socket_path(procs[0].pid).exists()  # the killed workers' sockets are removed
    print(f"\n{how}/{tool}: dump took {took:.2f} s; {wait}")
