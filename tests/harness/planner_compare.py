"""Measured model states and communication beside what ``tandem plan`` predicts for the same job.

    rows = compare(spec, world, nodes, measured_bytes_per_rank, measured_comm)

Model states: the planner's per-GPU parameters, gradients and optimizer bytes (ZeRO paper
formulas; fp32 storage: autocast keeps fp32 weights, so bf16 runs are planned as fp32) against the
local shards each rank holds. Communication: the planner's payload per step (bytes per call x
calls) per collective against the bytes the ranks handed to the process group.
"""

from __future__ import annotations

from tandem.plan.inputs.training import Strategy, Training
from tandem.plan.cost import evaluate
from tandem.plan.inputs.hardware import make_cluster
from tandem.plan.terms.memory import memory
from tandem.plan.inputs.model import GPTShape, gpt_stats

OPTIM = {"sgd": "sgd-momentum", "adamw": "adamw"}
KIND = {"all_reduce": "all_reduce", "reduce_scatter": "reduce_scatter", "all_gather": "all_gather",
        "send_recv": "send"}


def plan_for(spec, world: int, local_world: int):
    m = spec.model
    shape = GPTShape(layers=m.layers, hidden=m.hidden, heads=m.heads, kv_heads=m.kv_heads, ffn=m.ffn,
                     seq=m.seq, vocab=m.vocab, tied=m.tied)
    stats = gpt_stats(shape)
    cluster = make_cluster(gpus_per_node=local_world, nodes=max(1, world // local_world))
    training = Training(global_batch=spec.schedule.global_batch, precision="fp32",
                        optimizer=OPTIM[spec.optim.name])
    strategy = Strategy.from_job(spec, world, local_world)   # the trainer's own layout (ParallelDims)
    mb = spec.schedule.global_batch // (strategy.dp * spec.schedule.micro_batch)
    return stats, memory(stats, cluster, training, strategy, mb), evaluate(stats, cluster, training, strategy)


def planned_comm(plan) -> dict:
    """collective kind -> planned payload bytes per step (summed over the plan's ops of that kind)."""
    out: dict = {}
    for op in plan.comm:
        kind = KIND.get(op.collective, op.collective)
        out[kind] = out.get(kind, 0.0) + op.bytes * op.calls
    return out


def compare(spec, world: int, local_world: int, per_rank_bytes: list[dict], comm: dict) -> dict:
    stats, mem, plan = plan_for(spec, world, local_world)
    states = {}
    for key, planned in (("params", mem.params), ("grads", mem.grads), ("optimizer", mem.optimizer)):
        got = [b[key] for b in per_rank_bytes]
        states[key] = {"planned": planned, "measured_mean": sum(got) / len(got), "measured_max": max(got),
                       "ratio": (sum(got) / len(got)) / planned if planned else None}
    pc = planned_comm(plan)
    comms = {}
    for kind in sorted(set(pc) | set(comm)):
        got = comm.get(kind, {}).get("payload_bytes", 0.0)
        comms[kind] = {"planned": pc.get(kind, 0.0), "measured": got,
                       "ratio": got / pc[kind] if pc.get(kind) else None}
    return {"params": stats.params, "states": states, "comm": comms}
