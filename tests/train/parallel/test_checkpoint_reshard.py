"""DCP checkpoints across layouts: saved by one strategy and world size, loaded by another, with
identical weights (bitwise: DCP moves bytes, it does not compute)."""

from __future__ import annotations

import sys

import pytest
import torch

from harness.numerics import run_many, spawn

jobs = sys.modules["parallel_jobs"]   # loaded by this folder's conftest.py

SAVE4 = {  # name -> (spec on 4 ranks, how it is loaded on 2 ranks)
    "zero3": (jobs.gpt_job("zero3", world=4), jobs.gpt_job("ddp")),          # fsdp 4 ranks -> ddp 2 ranks
    "dp2xtp2": (jobs.gpt_job("zero3", tp=2, world=4), jobs.gpt_job("ddp")),  # tp 2 -> tp 1
    "dp2xpp2": (jobs.gpt_job("ddp", pp=2, world=4), jobs.gpt_job("zero2")),  # pp 2 -> zero2, no pp
    "hsdp": (jobs.gpt_job("hsdp", world=2), jobs.gpt_job("zero1")),          # hsdp 2x2 -> zero1
    "zero1": (jobs.gpt_job("zero1", world=4), jobs.gpt_job(tp=2)),           # zero1 4 ranks -> tp 2
}


def untied(spec):
    spec.model.tied = False   # a pipeline needs untied embeddings: every layout here uses the same model
    return spec


@pytest.mark.slow
def test_checkpoints_reshard_across_layouts(tmp_path):
    save = {n: (untied(a), {"save": str(tmp_path / n), "steps": 2}) for n, (a, _) in SAVE4.items()}
    saved = spawn(run_many, 4, save, steps=2, local_world=2)[0]
    load = {n: (untied(b), {"load": str(tmp_path / n / "step-00000002"), "steps": 0})
            for n, (_, b) in SAVE4.items()}
    loaded = spawn(run_many, 2, load, steps=0)
    for name in SAVE4:
        assert "error" not in saved[name], saved[name].get("error")
        for rank in loaded:
            got = rank[name]
            assert "error" not in got, got.get("error")
            assert set(got["state"]) == set(saved[name]["state"]), name
            for k, v in saved[name]["state"].items():
                assert torch.equal(v, got["state"][k]), (name, k)
        print(f"{name}: {saved[name]['dims']} -> {loaded[0][name]['dims']}: identical weights")
