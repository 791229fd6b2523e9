"""Activation memory per rank, counted where autograd keeps it, beside ``tandem plan``'s activation term.

    got = saved_activation_bytes(spec, ctx)     # one micro-batch's forward on this rank (cp-sharded)
    want = planned_activations(spec, world)     # the planner's activation bytes per GPU for the same job

Measured: every tensor the forward saves for the backward (``torch.autograd.graph.saved_tensors_hooks``),
each storage once, parameters left out: what a rank holds between its forward and its backward. It
counts fp32 tensors (the trainer's default precision); the planner prices the same job with fp32
activations (``Training(precision="fp32")``) and fused attention (tandem's SDPA and the ring store no
score matrix).
"""

from __future__ import annotations

import torch


def saved_activation_bytes(spec, ctx) -> dict:
    from harness.numerics import batches
    from tandem.train import runtime as rt
    from tandem.train.loss import resolve_loss
    from tandem.train.parallel import parallelize
    from tandem.train.parallel.materialize import Materializer, build_meta

    s = spec.schedule
    rt.seed_everything(s.seed)
    model = build_meta(spec.model, ctx.device)
    par = parallelize(model, spec, ctx, materialize=Materializer(s.seed, ctx.device))
    x, y = batches(spec, s.micro_batch)
    x, y = par.shard(x), par.shard(y)
    params = {p.untyped_storage().data_ptr() for p in par.root.parameters()}
    seen: dict = {}

    def pack(t: torch.Tensor):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    loss_fn = resolve_loss(spec.model.loss)
    with par.loss_context(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn(par.model, x, y)
    loss.backward()   # the ring's backward runs too: every cp rank takes part in each exchange
    return {"bytes": sum(seen.values()), "tokens": int(x.numel()), "rank": ctx.rank, "dims": par.dims.describe(),
            "ring_bytes": par.cp.sent_bytes if par.cp is not None else 0}


def _plan_inputs(spec, world: int):
    from tandem.plan.inputs.model import GPTShape, gpt_stats
    from tandem.plan.inputs.training import Strategy, Training

    m = spec.model
    shape = GPTShape(layers=m.layers, hidden=m.hidden, heads=m.heads, kv_heads=m.kv_heads, ffn=m.ffn,
                     seq=m.seq, vocab=m.vocab, tied=m.tied, gated=m.name == "llama", bias=m.name != "llama",
                     norm="rmsnorm" if m.name == "llama" else "layernorm", learned_pos=m.name != "llama",
                     dropout=False)   # tandem's decoders train without dropout: no mask bytes
    stats = gpt_stats(shape)
    training = Training(global_batch=spec.schedule.global_batch, precision="fp32", flash_attention=True)
    strategy = Strategy.from_job(spec, world, world)   # the trainer's layout: cp from the spec
    return stats, training, strategy


def planned_activations(spec, world: int) -> float:
    """``tandem plan``'s activation bytes per GPU (stored layers + the fp32 logits) for ``spec`` on ``world``."""
    from tandem.plan.terms.memory import activation_parts
    stats, training, strategy = _plan_inputs(spec, world)
    return activation_parts(stats, strategy, training, 1)["total"]


def planned_ring(spec, world: int) -> tuple[float, int]:
    """``tandem plan``'s cp-ring op for ``spec`` on ``world`` (one node): (bytes per call, calls per step)."""
    from tandem.plan.cost import evaluate
    from tandem.plan.inputs.hardware import make_cluster
    stats, training, strategy = _plan_inputs(spec, world)
    plan = evaluate(stats, make_cluster(gpus_per_node=world, nodes=1), training, strategy)
    op = next(o for o in plan.comm if o.name == "cp-ring")
    return op.bytes, op.calls


def run_and_measure(specs: dict, steps: int, mem: dict, ctx=None) -> dict:
    """The numerics configurations (``run_many``) and then each ``mem`` spec's saved activation bytes."""
    import torch.distributed as dist

    from harness.numerics import run_many
    out = run_many(specs, ctx, steps)
    for name, spec in mem.items():
        out[name] = saved_activation_bytes(spec, ctx)
        dist.barrier()
    return out
