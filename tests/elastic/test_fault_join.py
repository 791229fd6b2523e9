"""Elastic nnodes 1:2: a run on one node, then a second node joins the same c10d rendezvous;
torchrun's agent restarts the group at the larger world, which resumes from the checkpoint
the first node saved when it was stopped."""

import json

import pytest
from torch.distributed import TCPStore

from elastic.fault_helpers import finish, heartbeat, records, samples_seen, start_train, wait_for, write_spec

pytestmark = [pytest.mark.slow]


def test_node_joining_mid_run_grows_the_world_and_resumes(reference, tmp_path):
    # The rendezvous store on a host of its own (on a cluster: the --rdzv-endpoint host), so that
    # neither node's agent takes it away from the other when it exits.
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    spec = write_spec(tmp_path / "job.toml", tmp_path / "run", nproc=1)
    run = tmp_path / "run"
    elastic = ("--launch.nnodes", "1:2", "--launch.rdzv_endpoint", f"127.0.0.1:{store.port}")
    # rank 0 slowed (250 ms a micro-batch) so that one node's epoch outlasts the second node's startup;
    # on the first attempt only: the grown group (a later attempt, resume.agree_attempt) runs at full speed
    first = start_train(spec, *elastic, env={"TANDEM_FAULTS": "slow:rank=0:ms=250"})
    wait_for(lambda: (h := heartbeat(run, 0)) and h["step"] >= 11, timeout=240, what="rank 0 to reach step 11",
             interval=0.05)
    second = start_train(spec, *elastic, "--elastic.join", "true")
    rc, out, err = finish(first, timeout=400)
    rc2, out2, err2 = finish(second, timeout=120)
    assert rc == 0, err[-3000:]
    assert rc2 == 0, err2[-3000:]
    result = json.loads(out)
    assert json.loads(out2) == result  # both nodes see the run's one result
    starts = records(run, "start")
    assert [(s["world"], s["global_batch"], s["grad_accum"]) for s in starts] == [(1, 32, 4), (2, 32, 2)]
    assert (result["world"], result["step"], result["restarts"][0]["restart"]) == (2, 45, 1)
    restart = result["restarts"][0]
    resumed = restart["resumed_step"]
    # torchrun stops the first node's workers with SIGTERM: they checkpoint at an agreed step
    # (elastic.save_on_term), so the larger world redoes none
    (stop,) = records(run, "stop")
    assert resumed == stop["step"] >= 11 and starts[1]["start_step"] == resumed
    assert (restart["last_step_before"], restart["steps_redone"]) == (resumed, 0)
    rz = records(run, "resize")[0]
    assert (rz["old_world"], rz["new_world"], rz["old_grad_accum"], rz["new_grad_accum"]) == (1, 2, 4, 2)
    # every step trained on the same 32 samples as the uninterrupted 2-worker run: the position
    # carried over from world 1 to 2, nothing skipped or repeated in the epoch
    assert samples_seen(run) == reference["samples"]
    logs = "".join(p.read_text() for p in (run / "logs").glob("rank-*.log") if ".err" not in p.name)
    assert f"world size changed 1 -> 2: data position carried over ({resumed * 32} samples" in logs
    print(f"\njoin: resumed at step {resumed}, restart report {result['restarts'][0]}")
