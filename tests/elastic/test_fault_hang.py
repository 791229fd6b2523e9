"""SIGSTOP a worker: the watchdog notices, dumps stacks, names it, ends the group; then an
async save is cut short by SIGKILL. Checkpoints in this run are written with dcp.async_save."""

import json

import pytest

from elastic.fault_helpers import assert_bitwise_equal, final_state, finish, records, start_train, write_spec
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
    assert T <= latency <= T + 3, latency  # within T + a few seconds
    stacks1 = (wd / "stacks-rank-1.attempt0.txt").read_text()
    stacks0 = (wd / "stacks-rank-0.attempt0.txt").read_text()
    assert "faults.py" in stacks1 and "trainer.py" in stacks1  # where it stopped
    assert "trainer.py" in stacks0  # where the other rank waited for it
    assert "rank 1 stopped first" in err
    result = json.loads(out)
    hung, killed = result["restarts"]
    assert hung["detected_by"] == "watchdog" and hung["hang_first_rank"] == 1 and hung["resumed_step"] == 10
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
