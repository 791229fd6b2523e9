"""fp16, gradient clipping and a user's loss function through `tandem train` (2 gloo workers).

The loss, named by ``model.loss = "spiky_loss:loss"``, is the summed cross-entropy, except that
rank 0's third call returns inf: an overflow only rank 0 sees. The run must skip that step on
both ranks, halve the scale, say so in metrics.jsonl, log the global gradient norm of every
other step, and still learn.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from tandem_testing import ROOT, run_tandem

SPIKY = '''
import os
import torch.nn.functional as F

calls = 0


def loss(out, y):
    global calls
    calls += 1
    total = F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="sum", ignore_index=-100)
    if calls == 3 and os.environ.get("RANK") == "0":
        return total * float("inf")
    return total
'''


def _env(tmp: Path) -> dict:
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(tmp), str(ROOT), os.environ.get("PYTHONPATH")]))}


@pytest.mark.slow
def test_fp16_overflow_skipped_and_recorded_clip_logged(tmp_path):
    (tmp_path / "spiky_loss.py").write_text(SPIKY)
    run = tmp_path / "run"
    r = run_tandem("train", "examples/gpt_reverse.toml", "--precision.dtype", "fp16", "--optim.clip_grad_norm",
                   "1.0", "--model.loss", "spiky_loss:loss", "--schedule.max_steps", "12",
                   "--schedule.warmup_steps", "0", "--checkpoint.every_steps", "0", "--launch.run_dir", str(run),
                   env=_env(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in recs if x["kind"] == "step"]
    assert [x["step"] for x in steps] == list(range(1, 13))
    assert [x["skipped"] for x in steps] == [x["step"] == 3 for x in steps]
    assert steps[2]["grad_norm"] is None and steps[2]["loss_scale"] == steps[1]["loss_scale"] / 2
    assert all(math.isfinite(x["grad_norm"]) and x["grad_norm"] > 0 for x in steps if x["step"] != 3)
    start = next(x for x in recs if x["kind"] == "start")
    assert start["dtype"] == "fp16" and start["clip_grad_norm"] == 1.0
    assert steps[-1]["loss"] < steps[0]["loss"]
