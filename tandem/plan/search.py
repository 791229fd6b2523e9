"""Strategy search: enumerate every valid (dp, tp, pp, cp, ep, zero, micro-batch, recompute, schedule),
rank those that fit by step time (or by GPU-seconds per sample for --objective cost), and say
why the winner wins and why the near misses lose."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field, replace

from tandem.core.dims import ParallelDims
from tandem.plan.cost import Plan, check, evaluate
from tandem.plan.inputs.hardware import Cluster
from tandem.plan.inputs.model import ModelStats
from tandem.plan.inputs.training import Strategy, Training
from tandem.plan.terms.memory import memory
from tandem.plan.units import gib, ms


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def micro_batches(per_replica: int, limit: int = 12) -> list[int]:
    """Divisors of the per-replica batch, log-spaced when there are many."""
    ds = divisors(per_replica)
    if len(ds) <= limit:
        return ds
    pow2 = [d for d in ds if d & (d - 1) == 0]
    return sorted(set(pow2[:limit - 1] + [per_replica]))


@dataclass
class SearchResult:
    ranked: list[Plan]                       # fitting plans, best first
    oom: list[Plan]                          # fastest plans that do not fit
    counts: Counter = field(default_factory=Counter)
    seconds: float = 0.0
    objective: str = "time"
    notes: list[str] = field(default_factory=list)


def candidates(m: ModelStats, c: Cluster, t: Training, zeros=(0, 1, 2, 3), recomputes=None,
               schedules=("1f1b", "gpipe", "interleaved"), virtuals=(2, 4), hsdp=True):
    n = c.world
    is_gpt = m.gpt is not None
    if recomputes is None:   # with fused attention selective saves nothing over none and costs FLOPs
        recomputes = (("none", "full") if t.flash_attention else ("none", "selective", "full")) if is_gpt \
            else ("none",)
    tps = [d for d in divisors(n) if is_gpt or d == 1]
    moe = getattr(m, "moe", None)
    for tp, cp in ((tp, cp) for tp in tps for cp in context_degrees(m, n // tp)):
        if is_gpt and (m.gpt.heads % tp or m.gpt.ffn % tp):
            continue
        for pp, ep in ((pp, ep) for pp in (divisors(n // (tp * cp)) if is_gpt else [1])
                       for ep in expert_degrees(moe, n // (tp * cp * pp))):
            if is_gpt and m.gpt.layers % pp:
                continue
            dp = n // (tp * pp * cp)
            if t.global_batch % dp:
                continue
            per = t.global_batch // dp
            for mb in micro_batches(per):
                for zero in zeros:
                    if dp == 1 and zero > 0:
                        continue
                    if pp > 1 and zero >= 2:  # Megatron/DeepSpeed: ZeRO-2/3 do not combine with PP
                        continue
                    hs = (False, True) if hsdp and zero >= 1 and dp * tp > c.gpus_per_node else (False,)
                    for h in hs:
                        # the dims Strategy(dp=..., ...) would build, once for all the knobs below: the
                        # degrees are valid by construction (divisors; ep divides dp)
                        dims = ParallelDims.from_degrees(dp, tp, pp, zero, h, c.gpus_per_node, cp, ep)
                        for rc in recomputes:
                            scheds = [("1f1b", 1)] if pp == 1 else [
                                (sc, v) for sc in schedules for v in (virtuals if sc == "interleaved" else (1,))]
                            for sc, v in scheds:
                                yield Strategy(dims, micro_batch=mb, schedule=sc, virtual=v, recompute=rc)


CP_MIN_SEQ = 16384   # below it a sequence's activations fit without splitting it (the search tries cp 1 only)


def context_degrees(m: ModelStats, room: int) -> list[int]:
    """cp degrees worth trying: only for long sequences (the model needs it), powers of two that cut the
    sequence into 2 x cp equal chunks and divide the ranks left."""
    if m.gpt is None or m.gpt.seq < CP_MIN_SEQ:
        return [1]
    return [c for c in (1, 2, 4, 8, 16, 32) if room % c == 0 and m.gpt.seq % (2 * c) == 0]


def expert_degrees(moe, dp: int) -> list[int]:
    """ep degrees for an MoE model: divisors of dp that divide the experts (1 for a dense model)."""
    if moe is None:
        return [1]
    return [e for e in divisors(dp) if moe.experts % e == 0]


def search(m: ModelStats, c: Cluster, t: Training, objective: str = "time", top: int = 5,
           **kw) -> SearchResult:
    t0 = time.perf_counter()
    clusters = [c]
    if objective == "cost":  # fewer nodes may cost less per sample: try halves of the cluster
        k = c.nodes // 2
        while k >= 1:
            if c.nodes % k == 0:
                clusters.append(replace(c, nodes=k))
            k //= 2
    fits: list[Plan] = []
    oom: list[Plan] = []
    counts: Counter = Counter()
    for cl in clusters:
        memo: dict = {}   # evaluate's compute shared by candidates that differ in ZeRO, hsdp or schedule only
        for s in candidates(m, cl, t, **kw):
            why = check(m, cl, t, s)
            if why:
                counts["invalid: " + why.split(":")[0].split(" is")[0][:40]] += 1
                continue
            counts["evaluated"] += 1
            if not s.micro_batch:
                s.micro_batch = t.global_batch // s.dp
            mem = memory(m, cl, t, s, t.global_batch // (s.dp * s.micro_batch))
            if not mem.fits:
                counts["out of memory"] += 1
                if mem.total > 2 * mem.capacity:  # far out of memory: not worth timing as a near miss
                    continue
            p = evaluate(m, cl, t, s, mem, memo)
            (fits if mem.fits else oom).append(p)
    key = (lambda p: p.step_s * p.strategy.world / p.training.global_batch) if objective == "cost" \
        else (lambda p: p.step_s)
    fits.sort(key=key)
    oom.sort(key=key)
    return SearchResult(fits, oom[:top], counts, time.perf_counter() - t0, objective)


def _diff(win: Plan, other: Plan) -> str:
    parts = {
        "compute (incl. recompute)": other.compute_s - win.compute_s,
        "exposed communication": other.exposed_comm_s - win.exposed_comm_s,
        "pipeline bubble": other.bubble_s - win.bubble_s,
    }
    worst = max(parts, key=parts.get)
    if parts[worst] < 1e-3 * win.step_s:
        return "nothing: a tie (same predicted step; the model cannot tell them apart)"
    return f"+{ms(parts[worst])} {worst}"


def reasons(r: SearchResult, top: int = 5, refusal=None) -> list[str]:
    """Why the winner wins. ``refusal(plan)``: why tandem cannot train a plan (None: it can), marked on
    the winner and each near miss, so that the search never recommends an untrainable one silently."""
    def mark(p: Plan) -> str:
        why = refusal(p) if refusal else None
        return f" Not trainable by tandem yet: {why}." if why else ""

    out: list[str] = [f"searched {r.counts['evaluated']:,} strategies in {r.seconds:.2f} s; "
                      f"{len(r.ranked):,} fit in memory, {r.counts['out of memory']:,} do not."]
    if not r.ranked:
        out.append("nothing fits: use more GPUs, a GPU with more memory, or lower precision.")
    else:
        w = r.ranked[0]
        out.append(f"winner {w.strategy.label()} ({w.cluster.world} GPUs): step {ms(w.step_s)} = compute "
                   f"{ms(w.compute_s)} + exposed comm {ms(w.exposed_comm_s)} + bubble {ms(w.bubble_s)}; "
                   f"{gib(w.memory.total)} of {gib(w.memory.capacity)} per GPU.{mark(w)}")
        if refusal and refusal(w):
            ok = next((p for p in r.ranked if not refusal(p)), None)
            out.append(f"best that tandem trains: {ok.strategy.label()}: {ms(ok.step_s)} "
                       f"({ok.step_s / w.step_s - 1:+.1%}); --trainable ranks those only." if ok else
                       "no fitting strategy is one tandem trains yet.")
        seen = {w.strategy.label()}
        for p in r.ranked[1:]:
            if len(seen) > top:
                break
            lab = p.strategy.label()
            if lab in seen:
                continue
            seen.add(lab)
            out.append(f"near miss {lab}: {ms(p.step_s)} ({p.step_s / w.step_s - 1:+.1%}), loses by {_diff(w, p)}."
                       + mark(p))
        gpn = w.cluster.gpus_per_node
        cross = next((p for p in r.ranked if p.strategy.tp > gpn), None)
        if cross and cross is not w:
            tpc = sum(o.time_s for o in cross.comm if o.name == "tp-activations")
            out.append(f"TP across nodes, best {cross.strategy.label()}: {ms(cross.step_s)}; its tensor-parallel "
                       f"all-reduces take {ms(tpc)} on {cross.cluster.inter.name}.")
        bub = max((p for p in r.ranked[: 200] if p.bubble_s > 0), key=lambda p: p.bubble_s / p.step_s, default=None)
        if bub and bub is not w and bub.bubble_s / bub.step_s > 0.2:
            out.append(f"bubble too large, e.g. {bub.strategy.label()}: {bub.bubble_s / bub.step_s:.0%} of its "
                       f"step idles in the pipeline bubble.")
    for p in r.oom[:1]:
        if not r.ranked or p.step_s < r.ranked[0].step_s:
            out.append(f"out of memory, would be faster: {p.strategy.label()} at {ms(p.step_s)} needs "
                       f"{gib(p.memory.total)} > {gib(p.memory.capacity)} per GPU.")
    return out


def fitting_micro_batch(m: ModelStats, c: Cluster, t: Training, s: Strategy) -> Strategy | None:
    """The largest micro-batch that fits with the same degrees (gradient accumulation makes up the rest),
    with the least activation recompute that makes it fit."""
    per = t.global_batch // s.dp
    order = ("none", "selective", "full")
    for rc in order[order.index(s.recompute):]:
        for mb in reversed(divisors(per)):
            cand = replace(s, micro_batch=mb, recompute=rc)
            if check(m, c, t, cand) is None and evaluate(m, c, t, cand).memory.fits:
                return cand
    return None


def default_micro_batch(m: ModelStats, c: Cluster, t: Training, s: Strategy) -> Strategy:
    """A planner user who gives no --micro-batch: the largest that fits with these degrees and this
    recompute (gradient accumulation keeps the global batch), with at least pp micro-batches per step
    when there is a pipeline; micro-batch 1 (the least memory) when none fits."""
    per = t.global_batch // s.dp
    ds = [d for d in divisors(per) if s.pp == 1 or per // d >= s.pp] or [1]
    for mb in reversed(ds):
        cand = replace(s, micro_batch=mb)
        if check(m, c, t, cand) is None and evaluate(m, c, t, cand).memory.fits:
            return cand
    return replace(s, micro_batch=ds[0])
