"""Pipeline communication of a transformer step: the p2p sends between stages, the tied embedding's gradient
between the first and the last stage, and the per-micro-batch communication the pipeline's fill and drain repeat
(the tensor-parallel collectives: tensor_parallel.py). Returns CommOp fields as dicts (cost.py builds them), as
tensor_parallel.py, context.py and expert.py do.

Sources, read in Megatron-LM at commit 285068c8 (MegaScale's baseline, its §6.1) and on main:
- tensor parallel: 2 all-reduces forward + 2 backward a layer (Shoeybi et al. 2019), +2 with full recompute.
- pipeline p2p: b·s·h/t a boundary (megatron/p2p_communication.py sends s/t x b x h under sequence parallelism,
  or splits the tensor over the tp ranks, ``scatter_gather_tensors_in_pipeline``); 2·(m + p − 1)·v sends on the
  critical path: each warm-up forward, 1F1B pair and cool-down backward ends in one blocking call
  (tests/plan/megatron_schedule.py models that schedule; the count bounds it).
- pipeline p2p under Megatron-core's ``overlap_p2p_comm`` (``--overlap-p2p``; read at df727128, the commit MLPerf
  v3.1's NeMo GPT-3 submissions pin: megatron/core/pipeline_parallel/schedules.py, interleaved schedule only): the
  warm-up's and the steady state's calls are posted async (``wait_on_reqs=False``) and waited right before the
  tensor they bring is needed. A warm-up forward's is waited before the next forward, with nothing in between, and
  the cool-down's calls stay blocking, so what stays exposed is the fill and drain's chain through all p v chunks,
  2 (p v - 1) sends, plus in each steady 1F1B pair what a send takes beyond the chunk it hides behind (a forward's
  send behind the backward, a backward's behind the next forward). With m = p every chunk forward is warm-up (no
  steady state): the blocking count. tests/plan/megatron_schedule.py (``overlap=True``) runs that schedule event by
  event: exactly 2 (p v - 1) sends for m > p while a send is no longer than a chunk's forward. Beyond that the
  closed form approximates (a sweep to 4 x a chunk's forward and m to 8 p: -9% to +46% of the event model,
  over-charging as m grows); pipeline sends that long are rare (MLPerf's GPT-3: 0.27 ms against 2.3 ms). Layouts
  with p < m < 2 p that m does not divide, which Megatron-core refuses, get the same formula.
- the embedding's gradient: with a pipeline, the last stage holds a copy of the tied word embedding and after
  the last backward both copies' gradients are all-reduced over the 2-rank embedding group before the optimizer
  step (285068c8: megatron/optimizer/optimizer.py ``allreduce_word_embedding_grads``, on the main_grad buffer,
  FP32 under BF16; main: megatron/core/distributed/finalize_model_grads.py ``_allreduce_word_embedding_grads``,
  after the data-parallel gradient sync): exposed, once a step.
- fill and drain: stages.fill_units counts them in mean-stage micro-batch times; a micro-batch's time on a stage
  includes its exposed tensor-parallel (and ring-attention / expert all-to-all) communication, which runs inside
  each chunk as it does in the steady state, so the bubble repeats that communication too.
"""

from __future__ import annotations

from tandem.plan.terms.collectives import Group, collective, grad_reduce_bytes, link_name, p2p

# per-micro-batch, per-layer communication on the stage's critical path: the fill and drain repeat it
PER_MICRO_BATCH = ("tp-activations", "cp-ring", "ep-all-to-all")


def pp_ops(m, c, t, s, mb: int, stage_s: float = 0.0) -> list[dict]:
    """pp-p2p and embedding-grad for a transformer ``m`` (ModelStats) under strategy ``s`` with pp > 1;
    ``stage_s`` the slowest stage's compute a step, which --overlap-p2p hides steady-state sends behind."""
    g, by, gpn = m.gpt, t.bytes, c.gpus_per_node
    act = s.micro_batch * g.seq // s.cp * g.hidden * by["act"]
    ops: list[dict] = []
    cross = s.tp * s.dp >= gpn
    ppg = Group(s.pp, 1 if cross else s.pp, s.pp if cross else 1)
    calls = 2 * (mb + s.pp - 1) * s.virtual
    one = p2p(act / s.tp, cross, c)
    op = _op("pp-p2p", "send_recv", act / s.tp, calls, ppg, c.inter.name if cross else c.intra.name, one * calls)
    op["algorithm"] = "p2p"   # collectives.p2p: bytes over one link + its latency
    if async_p2p(t, s, mb):
        chunk = stage_s / (mb * s.virtual) / 3   # a chunk's forward; its backward twice that
        op.update(exposed_s=p2p_exposed(one, s.pp, s.virtual, mb, chunk), rule="pp-async", window_s=chunk)
    ops.append(op)
    if g.tied:
        # one GPU of the first stage and its peer on the last: other nodes unless the whole pipeline fits in one
        eg = Group(2, 1, 2) if cross else Group(2, 2, 1)
        nbytes = g.vocab * g.hidden / s.tp * grad_reduce_bytes(t.precision, s.zero, by["grad"], t.grad_reduce)
        tm, algo = collective("all_reduce", nbytes, 1, eg, c)
        ops.append(dict(_op("embedding-grad", "all_reduce", nbytes, 1, eg, link_name(eg, c), tm), algorithm=algo))
    return ops


def async_p2p(t, s, mb: int) -> bool:
    """--overlap-p2p takes effect: the interleaved schedule with a steady state (m > p)."""
    return t.overlap_p2p and s.pp > 1 and s.schedule == "interleaved" and s.virtual > 1 and mb > s.pp


def steady_pairs(p: int, v: int, mb: int) -> int:
    """1F1B pairs of the first stage, the one with the most warm-up forwards ((p - 1) x 2 + (v - 1) x p)."""
    return mb * v - min(mb * v, 2 * (p - 1) + (v - 1) * p)


def p2p_exposed(one: float, p: int, v: int, mb: int, fwd: float) -> float:
    """Seconds of pipeline sends on the critical path under overlap_p2p_comm (module docstring): the fill and
    drain's 2 (p v - 1), and each steady pair's excess over the chunk it hides behind (backward 2 x ``fwd``)."""
    return 2 * (p * v - 1) * one + steady_pairs(p, v, mb) * (max(0.0, one - 2 * fwd) + max(0.0, one - fwd))


def _op(name, collective, nbytes, calls, group, link, tm) -> dict:
    return dict(name=name, collective=collective, bytes=nbytes, calls=calls, group=group, link=link, time_s=tm,
                exposed_s=tm)


def bubble_comm(ops, counts: tuple[int, ...], layers: int, pp: int, bubble: float, compute: float) -> float:
    """Seconds of per-micro-batch communication inside the fill and drain: the mean stage's share of the slowest
    stage's exposed per-micro-batch communication (ops are charged on the slowest stage's layers) x the fill in
    micro-batch times (bubble / compute = fill / m, compute the mean stage's before the imbalance)."""
    if bubble <= 0 or compute <= 0:
        return 0.0
    per_mb = sum(o.exposed_s for o in ops if o.name in PER_MICRO_BATCH)
    mean_over_max = layers / pp / max(counts) if counts else 1.0
    return per_mb * mean_over_max * bubble / compute
