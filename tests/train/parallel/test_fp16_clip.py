"""fp16 (autocast + GradScaler, on CPU) and global-norm gradient clipping on ddp, zero3, tp and pp:
2 gloo ranks against one process, through the trainer's own Stepper (tandem/train/step.py).

fp16: an inf put into one gradient element of rank 1 only (one FSDP shard, one tp shard, one
pipeline stage) after the backward: every rank skips that step (weights unchanged), the scale
halves on every rank, the step is reported skipped; the other steps learn, and the losses follow
the single-process fp16 run with the same injected inf. Clipping: the global norm before clipping
equals the single-process norm within 1e-5 (relative) at every step, and the clipped run's losses
and weights match the single process as the unclipped strategies do (test_numerics.py).
"""

from __future__ import annotations

import math
import sys

import pytest

from harness.numerics import run_steps_single

jobs = sys.modules["parallel_jobs"]  # loaded by this folder's conftest.py
STRATEGIES, STEPS, INF_AT, CLIP = jobs.FP16_CLIP, jobs.STEPS, jobs.INF_AT, jobs.CLIP  # the runs: parallel_jobs.py


@pytest.mark.slow
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_fp16_skips_an_overflow_on_every_rank_and_learns(name, runs):
    cfgs, ranks = runs(2)
    spec, kw = cfgs[f"{name}-fp16"]
    ref = run_steps_single(spec, STEPS, inf_at=INF_AT, inf_rank=0)
    expect = [i == INF_AT for i in range(STEPS)]
    assert ref["skipped"] == expect and ref["unchanged"]
    for r in (rank[f"{name}-fp16"] for rank in ranks):
        assert "error" not in r, r.get("error")
        assert r["skipped"] == expect, r["skipped"]          # every rank skipped the step, and only it
        assert r["unchanged"], "the skipped step changed weights"
        s = r["scales"]
        assert s[INF_AT] == s[INF_AT - 1] / 2 and s == ref["scales"], s
        assert not math.isfinite(r["grad_norms"][INF_AT])
        assert r["losses"][-1] < r["losses"][0], r["losses"]  # it learns
        for a, b in zip(r["losses"], ref["losses"]):
            assert abs(a - b) <= 2e-2 * abs(b), (r["losses"], ref["losses"])
    assert ranks[0][f"{name}-fp16"]["scales"] == ranks[1][f"{name}-fp16"]["scales"]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_clipped_global_norm_matches_one_process(name, runs):
    cfgs, ranks = runs(2)
    spec = cfgs[f"{name}-clip"]
    ref = run_steps_single(spec, STEPS)
    assert all(n > CLIP for n in ref["grad_norms"]), "every step is clipped"  # so clipping acts
    for r in (rank[f"{name}-clip"] for rank in ranks):
        assert "error" not in r, r.get("error")
        for a, b in zip(r["grad_norms"], ref["grad_norms"]):
            assert abs(a - b) <= 1e-5 * b, (name, r["grad_norms"], ref["grad_norms"])
        for a, b in zip(r["losses"], ref["losses"]):
            assert abs(a - b) <= 1e-5 * abs(b), (name, r["losses"], ref["losses"])
        worst = max((r["state"][k] - ref["state"][k]).abs().max().item() for k in ref["state"])
        assert worst <= 2e-5, (name, worst)
