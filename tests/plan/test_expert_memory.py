"""The planner's expert memory under ep x tp against what tandem's trainer holds, per rank, on real processes.

examples/moe_reverse.toml (a Llama with 4 SwiGLU experts of 64 units in each of 2 blocks, hidden 64: 98,304
routed-expert weights) at ep 2 x tp 2 on 4 gloo ranks, AdamW, one step. tandem's trainer keeps each ep rank's
2 experts whole on both its tp ranks (runtime tandem, experts_tp False): 49,152 weights a rank, / ep only, their
gradients summed and their zero2 / zero3 shards over edp x tp = 2 ranks. Megatron's layout (experts split over
tp too) would hold half of that under ddp; ``tandem plan --runtime megatron`` still plans it so.
Measured (ddp / zero2 / zero3, bytes a rank): params 196,608 / 98,304 / 98,304, grads 196,608 / 98,304 / 98,304,
AdamW state 393,216 / 196,608 / 196,608: the planner's, byte for byte, but zero2's parameters, which FSDP2 keeps
as shards at rest (1/2 of the planner's full copy, as tests/train/parallel/test_states_and_comm.py asserts for
dense models).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.moe import expert_state_bytes
from harness.numerics import spawn
from tandem.core.config import load_spec
from tandem.plan.cost import evaluate, validate
from tandem.plan.inputs.args import PlanArgs, resolve, strategy
from tandem.plan.terms.memory import expert_state_bytes as planned_expert_bytes

SPEC = Path(__file__).resolve().parents[2] / "examples" / "moe_reverse.toml"
ZERO = {"ddp": 0, "zero2": 2, "zero3": 3}


def job(name: str):
    return load_spec(SPEC, {"parallel.ep": "2", "parallel.tp": "2", "launch.nproc_per_node": "4",
                            "parallel.strategy": name})


def plan(zero: int, runtime: str = "tandem"):
    """`tandem plan --config examples/moe_reverse.toml --tp 2 --gpus-per-node 4 --zero Z [--runtime R]` (the
    spec gives the experts and ep 2): the plan and its expert bytes per GPU."""
    a = PlanArgs(config=str(SPEC), gpus_per_node=4, tp=2, zero=zero, runtime=runtime)
    m, c, t, v = resolve(a)
    s = strategy(v, c, t)
    validate(m, c, t, s)
    assert (t.precision, t.optimizer, s.dp, s.tp, s.ep) == ("fp32", "adamw", 2, 2, 2)
    return evaluate(m, c, t, s), planned_expert_bytes(m, c, t, s)


@pytest.fixture(scope="module")
def measured():
    return spawn(expert_state_bytes, 4, {name: job(name) for name in ZERO})


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ZERO))
def test_planned_expert_states_per_rank_are_what_ep2_tp2_ranks_hold(measured, name):
    p, want = plan(ZERO[name])
    for r, ranks in enumerate(measured):
        got = ranks[name]
        assert got["dims"] == measured[0][name]["dims"]
        for key in ("grads", "optimizer"):
            assert got[key] == want[key], (name, r, key, got[key], want[key])
        # FSDP2's zero2 reshards after backward: the parameters rest as shards over edp x tp
        assert got["params"] == want["params"] / (got["grad_group"] if name == "zero2" else 1), (name, r)
    # the expert gradients go over the ranks the trainer sums them on (edp 1 x tp 2), this rank's experts whole
    eg = next(o for o in p.comm if o.name == "ep-grad")
    assert eg.group.size == measured[0][name]["grad_group"] == 2
    assert eg.bytes == measured[0]["ddp"]["grads"]   # all-reduced (ddp) or reduce-scattered whole
    if name == "ddp":   # Megatron's layout (experts / (ep x tp)) plans half of what tandem's ranks hold
        mega = plan(0, "megatron")[1]
        assert mega["params"] == measured[0][name]["params"] / 2 and mega["grads"] == want["grads"] / 2
