"""diagnose tells the rest of a run's story: the hang watchdog's reports and an NCCL log, with or without
a profiler window (the `tandem diagnose` CLI on a run dir built from the files those tools write)."""

import json
from pathlib import Path

from tandem_testing import run_tandem

DATA = Path(__file__).parent / "data"

# what tandem/launch/watchdog.py writes (docs/elastic.md, from tests/elastic/test_fault_hang.py), abridged
HANG = {"detected_at": 1000.0, "timeout_s": 4, "node": 0, "attempt": 0, "host": "vm", "first_stopped_rank": 1,
        "why": "its process is stopped (state T, e.g. SIGSTOP)", "stale_s": {"0": 4.1, "1": 4.4},
        "ranks": {"0": {"step": 16, "phase": "sync", "pid": 11, "state": "S", "last_beat": 995.9},
                  "1": {"step": 15, "phase": "data", "pid": 12, "state": "T", "last_beat": 995.6}},
        "stacks": {"1": {"tool": "faulthandler", "file": "/x/stacks-rank-1.attempt0.txt"}},
        "stack_files": {"1": "/x/stacks-rank-1.attempt0.txt"},
        "collectives": {}, "collective_waits": [
            "default_pg: rank(s) [0] wait in #129 gloo:broadcast [[600]] (and 1 more after it), which rank(s) [1] "
            "never entered (last entered: #128)"]}


def test_a_hung_run_without_a_profile_gets_its_hang_and_nccl_story(tmp_path):
    run = tmp_path / "run"
    (run / "watchdog").mkdir(parents=True)
    (run / "watchdog" / "hang-attempt0-node0.json").write_text(json.dumps(HANG))
    p = run_tandem("diagnose", str(run), "--nccl-log", str(DATA / "socket_despite_ib.log"))
    assert p.returncode == 0, p.stderr
    out = " ".join(p.stdout.split())
    assert "no profiler window" in out
    assert "hang: rank 1 stopped first (restart attempt 0)" in out
    assert "flight recorder: default_pg: rank(s) [0] wait in #129" in out and "rank 1's stacks: /x/stacks" in out
    assert "nccl: socket despite InfiniBand (fail)" in out
    rep = json.loads((run / "diagnose.json").read_text())
    kinds = [v["kind"] for v in rep["verdicts"]]
    assert kinds[0] == "hang" and "nccl" in kinds and rep["hangs"][0]["steps"] == {"0": 16, "1": 15}
    assert rep["nccl"]["transports"] and rep["nccl"]["file"].endswith("socket_despite_ib.log")


def test_a_clean_nccl_log_adds_no_finding(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    p = run_tandem("diagnose", str(run), "--nccl-log", str(DATA / "two_nodes_ib.log"), "--json")
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout)
    assert rep["verdicts"] == [] and rep["nccl"]["network"] == "IB"


def test_not_an_nccl_log_is_one_line(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    junk = tmp_path / "junk.log"
    junk.write_text("hello\n")
    p = run_tandem("diagnose", str(run), "--nccl-log", str(junk))
    assert p.returncode == 2 and p.stderr.startswith("error: --nccl-log: no NCCL lines"), p.stderr
    assert not (run / "diagnose.json").exists()
    # and a run dir with nothing at all still says how to profile it
    p = run_tandem("diagnose", str(run))
    assert p.returncode == 2 and "no profiler window in this run" in p.stderr
