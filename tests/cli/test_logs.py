"""`tandem logs RUN_DIR`: rank logs with [rank R] prefixes, the current attempt, --follow until the job ends."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tandem_testing import ROOT, tandem_in_process, wait_for


def write_logs(run, names: dict[str, str], attempts: int = 1) -> None:
    (run / "logs").mkdir(parents=True)
    for name, text in names.items():
        (run / "logs" / name).write_text(text)
    # starts by a process that has exited (pid 1 started long before these records: not theirs)
    (run / "attempts.jsonl").write_text("".join(json.dumps({"attempt": a, "pid": 1, "host": "elsewhere.invalid",
                                                            "time": 0}) + "\n" for a in range(1, attempts + 1)))


def test_prints_the_current_attempt_with_rank_prefixes(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    write_logs(run, {"rank-0.log": "old 0\n", "rank-1.log": "old 1\n",
                     "rank-0.attempt2.log": "step 1\nstep 2\n", "rank-1.attempt2.log": "step 1\n",
                     "rank-1.attempt2.err.log": "Traceback\n", "rank-1.attempt2.restart1.log": "again\npartial"},
               attempts=2)
    code, out, err = tandem_in_process(["logs", str(run)], capsys, monkeypatch)
    assert code == 0, err
    assert out.splitlines() == ["[rank 0] step 1", "[rank 0] step 2", "[rank 1] step 1", "[rank 1 stderr] Traceback",
                                "[rank 1 restart 1] again", "[rank 1 restart 1] partial"]
    code, out, _ = tandem_in_process(["logs", str(run), "--attempt", "1", "--rank", "1"], capsys, monkeypatch)
    assert code == 0 and out == "[rank 1] old 1\n"


def test_bad_run_dir_rank_or_attempt_is_one_line(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    (tmp_path / "empty").mkdir()
    code, _, err = tandem_in_process(["logs", str(tmp_path / "empty")], capsys, monkeypatch)
    assert code == 2 and err.strip() == (f"error: run_dir: no rank logs in the run dir (got '{tmp_path / 'empty'}'). "
                                         "Fix: give the run dir of a job that has started (logs are in "
                                         "logs/rank-R.log)")
    write_logs(run, {"rank-0.log": "a\n", "rank-1.log": "b\n"})
    code, _, err = tandem_in_process(["logs", str(run), "--rank", "2"], capsys, monkeypatch)
    assert code == 2 and err.strip() == "error: --rank: no such rank in attempt 1 (got 2). Fix: use one of 0, 1"
    code, _, err = tandem_in_process(["logs", str(run), "--attempt", "2"], capsys, monkeypatch)
    assert code == 2 and err.strip().startswith("error: --attempt: the run dir has attempts 1 to 1 (got 2)."), err
    code, _, err = tandem_in_process(["logs", str(tmp_path / "nope")], capsys, monkeypatch)
    assert code == 2 and err.startswith("error: run_dir: no such run dir"), err


def test_a_slurm_job_points_to_its_sbatch_output(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    write_logs(run, {"rank-0.log": "hi\n"})
    (run / "submit").mkdir()
    (run / "submit" / "job.json").write_text(json.dumps({"engine": "slurm", "job_id": "17"}))
    code, out, err = tandem_in_process(["logs", str(run)], capsys, monkeypatch)
    assert code == 0 and out == "[rank 0] hi\n"
    assert err.strip() == f"slurm job 17: sbatch output in {run / 'submit'}/slurm-17.out"


def test_follow_prints_new_lines_until_the_job_ends(tmp_path):
    """A real `tandem launch` whose ranks wait for a file: --follow has printed their first lines and
    still runs; once they finish it prints their last lines and exits by itself."""
    script, go, run = tmp_path / "two_lines.py", tmp_path / "go", tmp_path / "run"
    script.write_text("import os, pathlib, sys, time\n"
                      "rank = os.environ['RANK']\n"
                      "print(f'first line of rank {rank}', flush=True)\n"
                      "t = time.monotonic()\n"
                      "while not pathlib.Path(sys.argv[1]).exists() and time.monotonic() - t < 300:\n"
                      "    time.sleep(0.05)\n"
                      "print(f'last line of rank {rank}', flush=True)\n")
    env = {**os.environ, "COLUMNS": "200"}
    tandem = [sys.executable, "-m", "tandem"]
    launch = subprocess.Popen([*tandem, "launch", "--nproc-per-node", "2", "--run-dir", str(run), "--quiet",
                               str(script), str(go)], env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    try:
        wait_for(lambda: all("first" in _text(run / "logs" / f"rank-{r}.log") for r in (0, 1)), 120,
                 "both ranks' first line")
        with open(out, "w") as o, open(err, "w") as e:
            follow = subprocess.Popen([*tandem, "logs", str(run), "--follow"], env=env, cwd=ROOT, stdout=o, stderr=e)
        wait_for(lambda: _text(out).count("first line") == 2, 120, "--follow to print the first lines")
        assert follow.poll() is None, _text(err)  # the job still runs: so does --follow
        go.touch()
        assert follow.wait(timeout=120) == 0, _text(err)
        assert launch.wait(timeout=120) == 0
    finally:
        go.touch()
        launch.kill()
    assert sorted(_text(out).splitlines()) == ["[rank 0] first line of rank 0", "[rank 0] last line of rank 0",
                                               "[rank 1] first line of rank 1", "[rank 1] last line of rank 1"]
    assert _text(err).strip() == "tandem logs: the job has ended (its process has exited)"


def _text(path) -> str:
    return path.read_text() if path.exists() else ""
