"""Output read through a pipe (a log file, CI) has whole lines: rich's 80-column default for a
non-terminal cut the progress line (`0:0…`) and wrapped one-line verdicts."""

import pytest
import os
import re
import subprocess
import sys

from tandem_testing import ROOT


@pytest.mark.slow
def test_piped_train_progress_line_is_whole(tiny_spec):
    spec = tiny_spec(max_steps=2, nproc=1, every=0)  # max_steps ends the run inside its epoch: scored at the end
    env = {**{k: v for k, v in os.environ.items() if k != "COLUMNS"}, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "tandem", "train", str(spec)], capture_output=True, text=True,
                       timeout=240, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    (bar,) = [line for line in r.stdout.splitlines() if line.startswith("train ")]
    assert "…" not in bar and len(bar) > 80, bar
    assert re.search(r" 2/2 \d+:\d\d:\d\d 1 workers \| loss \d+\.\d{3} \| \d+ samples/s in steps \| acc \d\.\d{3}$", bar), bar
    done = [line for line in r.stdout.splitlines() if line.startswith("done: ")]
    assert len(done) == 1 and " held-out accuracy 0." in done[0], r.stdout
    # the two throughputs, each named for what it measures (tandem/train/metrics.py)
    assert re.search(r", \d+ samples/s in training steps \(\d+/s wall, incl\. eval and checkpoints\), ", done[0]), done
