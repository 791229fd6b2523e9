"""core/steps.py: the steps a run trains, the one count the trainer and `tandem plan --config` share."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from torch.utils.data import DistributedSampler

from tandem.core.config import load_spec
from tandem.core.steps import held_out_count, planned_steps, rank_epoch_len, steps_per_epoch, total_steps
from tandem.plan.inputs.args import PlanArgs, merge
from tandem_testing import ROOT


@pytest.mark.parametrize("n,ranks,drop", list(itertools.product([7, 64, 65, 3686, 7373], [1, 2, 3, 4], [False, True])))
def test_a_ranks_share_is_torchs_distributed_sampler(n, ranks, drop):
    s = DistributedSampler(torch.arange(n), num_replicas=ranks, rank=0, shuffle=False, drop_last=drop)
    assert rank_epoch_len(n, ranks, drop, per_step=32, whole_steps=False) == s.num_samples
    whole = rank_epoch_len(n, ranks, drop, per_step=32, whole_steps=True)
    assert whole % 32 == 0 and s.num_samples - 32 < whole <= s.num_samples


def test_epochs_and_max_steps():
    assert steps_per_epoch(3687, 32) == 116 and steps_per_epoch(3680, 32) == 115
    assert total_steps(2, 116, 0) == 232 and total_steps(2, 116, 120) == 120 and total_steps(1, 116, 120) == 116
    assert held_out_count(8192, 0.1) == 819 and held_out_count(10, 0.0) == 0 and held_out_count(2, 0.9) == 1


def test_gpt_reverse_trains_116_steps_and_plan_config_says_so():
    """8192 strings, 819 held out: 7373 over 2 ranks, 3687 each, 32 a step: 116 < max_steps 120."""
    spec = load_spec(str(ROOT / "examples/gpt_reverse.toml"), {}, check=False)
    assert planned_steps(spec, world=2) == 116
    v, _ = merge(PlanArgs(config=str(ROOT / "examples/gpt_reverse.toml")))
    assert v["steps"] == 116
    # the layout the plan is asked about: 4 ranks at the same batch, micro 16 (accumulation 1)
    assert planned_steps(spec, world=4, micro_batch=16) == 116
    v, _ = merge(PlanArgs(config=str(ROOT / "examples/gpt_reverse.toml"), steps=500))
    assert v["steps"] == 500  # --steps given: the plan prices what it is told
    two = dataclasses.replace(spec, schedule=dataclasses.replace(spec.schedule, epochs=2))
    assert planned_steps(two, world=2) == 120


def test_data_known_only_when_loaded_falls_back_to_max_steps():
    spec = load_spec(str(ROOT / "examples/gpt_reverse.toml"), {}, check=False)
    npz = dataclasses.replace(spec, data=dataclasses.replace(spec.data, name="npz"))
    assert planned_steps(npz, world=2) == 120
    npz = dataclasses.replace(npz, schedule=dataclasses.replace(npz.schedule, max_steps=0))
    assert planned_steps(npz, world=2) is None
