"""The planner's degrees are ParallelDims (tandem.core.dims), the object the trainer builds its mesh from."""

import pytest

from tandem.core.config import load_spec
from tandem.core.dims import ParallelDims, from_spec
from tandem.core.errors import ConfigError
from tandem.plan.inputs.args import PlanArgs, resolve, strategy
from tandem.plan.inputs.training import Strategy
from tandem_testing import ROOT

GPT = ROOT / "examples" / "gpt_reverse.toml"


def test_planner_degrees_are_parallel_dims():
    s = Strategy(dp=8, tp=2, zero=3, micro_batch=1)
    assert s.dims == ParallelDims(world=16, pp=1, dp_replicate=1, dp_shard=8, tp=2, strategy="zero3")
    assert (s.dp, s.tp, s.pp, s.zero, s.hsdp, s.world) == (8, 2, 1, 3, False, 16)
    # hybrid: sharded over a node's dp ranks (8 GPUs / tp 2 = 4), replicated across 4 nodes
    h = Strategy(dp=16, tp=2, zero=3, hsdp=True, ranks_per_node=8)
    assert (h.dims.strategy, h.dims.dp_shard, h.dims.dp_replicate, h.hsdp) == ("hsdp", 4, 4, True)
    assert "z3h" in h.label()
    # hybrid ZeRO-1 (the planner prices it; the trainer has no such strategy): replicate > 1 says so
    z1 = Strategy(dp=16, zero=1, hsdp=True, ranks_per_node=8)
    assert (z1.dims.strategy, z1.dims.dp_replicate, z1.zero, z1.hsdp) == ("zero1", 2, 1, True)
    # a shard group must divide dp (a DeviceMesh): 12 ranks over nodes of 8 shard by 6
    assert Strategy(dp=12, zero=3, hsdp=True, ranks_per_node=8).dims.dp_shard == 6
    assert Strategy(dp=8, zero=2).with_zero(3).dims.strategy == "zero3"


def test_bad_degrees_name_the_flag():
    with pytest.raises(ConfigError, match="zero"):
        Strategy(dp=2, zero=4)
    with pytest.raises(ConfigError) as e:
        Strategy(dp=0)
    assert e.value.field == "dp"


def test_from_job_is_the_trainers_layout():
    spec = load_spec(GPT, ["--parallel.strategy", "hsdp", "--parallel.dp_shard", "2",
                           "--launch.nproc_per_node", "4", "--schedule.micro_batch", "8"], check=False)
    s = Strategy.from_job(spec, world=8, local_world=4)
    assert s.dims == from_spec(spec, 8, 4, warn=False)
    assert (s.dims.dp_shard, s.dims.dp_replicate, s.zero, s.micro_batch) == (2, 4, 3, 8)


def test_plan_of_a_job_spec_reads_its_parallel_section(tmp_path):
    """`tandem plan --config`: hsdp's dp_shard comes from the spec (the planner's own rule would shard
    over the whole node); a degree flag switches to the flags' degrees."""
    p = tmp_path / "job.toml"
    p.write_text(GPT.read_text() + '\n[parallel]\nstrategy = "hsdp"\ndp_shard = 2\n')
    m, c, t, v = resolve(PlanArgs(config=str(p), gpus_per_node=4, nodes=2))
    s = strategy(v, c, t)
    assert (s.dims.strategy, s.dims.dp_shard, s.dims.dp_replicate) == ("hsdp", 2, 4)
    m, c, t, v = resolve(PlanArgs(config=str(p), gpus_per_node=4, nodes=2, zero=3, hsdp=True))
    assert strategy(v, c, t).dims.dp_shard == 4  # flags: the node's dp ranks


def test_plan_refuses_a_spec_the_trainer_refuses():
    m, c, t, v = resolve(PlanArgs(config=str(GPT), gpus_per_node=3, nodes=1))
    v["_job"].parallel.tp = 2
    with pytest.raises(ConfigError) as e:
        strategy(v, c, t)
    assert e.value.field == "parallel.tp"  # the trainer's own check, its own words
