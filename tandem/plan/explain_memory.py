"""explain[] sentences for memory: an MoE model's states, the per-layer activation arithmetic behind the memory
line (Korthikanti et al. 2022, Table 2 and Section 4.2.3) with the layers a pipeline stage holds in flight, and
what gradient sync under a pipeline (grad_sync.py) holds at the peak."""

from __future__ import annotations

from tandem.plan.cost import Plan
from tandem.plan.inputs.model import mlp_act_coeff
from tandem.plan.inputs.training import fused_attention
from tandem.plan.terms.collectives import grad_reduce_bytes
from tandem.plan.terms.grad_sync import deferred, reductions
from tandem.plan.terms.memory import FUSED_LOSS_BYTES, LOSS_PARALLEL_BYTES, UNFUSED_LOSS_BYTES, activation_parts, loss_bytes, op_sac
from tandem.plan.terms.params import expert_shard_group, expert_states, expert_tp, shard_group
from tandem.plan.terms.stages import chunks, rounds, stage_inflight
from tandem.plan.units import gib


def moe_states_sentence(p: Plan) -> str:
    """Where an MoE model's parameters sit: the non-expert ones as a dense model's, the experts over ep (and tp
    where the runtime splits them)."""
    m, s, t, c = p.model, p.strategy, p.training, p.cluster
    dense, expert = expert_states(m, s, t)
    d, de = shard_group(s, c), expert_shard_group(s, c, t)
    k = t.bytes["param"] + t.bytes["grad"] + t.optimizer_bytes
    if expert_tp(t, s) == s.tp:
        split_by, over = f"/ (ep {s.ep} x tp {s.tp})", "dp x cp / ep"
    else:   # tandem's trainer: each tp rank holds its ep rank's experts whole (runtime.py, experts_tp)
        split_by, over = f"/ ep {s.ep}, whole on each of the tp {s.tp} ranks", "(dp x cp / ep) x tp"
    return (f"Model states (MoE): {dense / 1e9:.4g}B non-expert parameters per GPU (/ tp {s.tp} on the stage "
            f"holding the most; ZeRO-{s.zero} shards over dp x cp = {d}) + {expert / 1e9:.4g}B expert parameters "
            f"per GPU ({split_by} on that stage; ZeRO-{s.zero} shards over {over} = {de}), "
            f"{k} bytes each before sharding.")


def activation_sentence(p: Plan) -> str:
    """The per-layer activation arithmetic behind the memory line (Korthikanti et al. 2022, Table 2)."""
    m, s, t = p.model, p.strategy, p.training
    g = m.gpt
    parts = activation_parts(m, s, t, p.grad_accum)
    per, layers = parts["per_layer"], parts["layers"]
    sq = g.seq // s.cp
    sbh = (f"s x b x h = {g.seq}/cp {s.cp} x" if s.cp > 1 else f"s x b x h = {g.seq} x") \
        + f" {s.micro_batch} x {g.hidden}"
    if s.recompute == "full":
        form = f"2 x {sbh} / tp {s.tp} (full recompute keeps the layer input)"
    elif s.recompute == "selective" and op_sac(t, m):
        form = (f"{sbh} x (2 x ((3h + kv + ffn)/tp + h) + 4 heads/tp)/h bytes (torchtitan's per-op selective checkpointing: "
                f"block input, wq, wv, w1, w2 and SDPA outputs kept, the rest recomputed; h {g.hidden}, kv "
                f"{g.kv_dim}, ffn {g.ffn}, tp {s.tp})")
    else:
        mlp = 3 + (6 if g.gated else 4) * g.ffn / g.hidden
        mlp_note = ""
        if m.moe is not None:
            e = m.moe
            mlp = mlp_act_coeff(e)
            k = 6 if g.gated else 4
            mlp_note = (f", MoE MLP 3 + (top_k x capacity + shared) x (2 + {k} x expert_ffn/h) = 3 + "
                        f"({e.top_k} x {e.capacity_factor:g} + {e.shared}) x (2 + {k * e.expert_ffn / g.hidden:.4g})"
                        f" = {mlp:.4g}")
        lin = (7 + 4 * g.kv_heads / g.heads) + mlp + 4 - (0 if g.dropout else 2)   # no dropout: no masks
        mlp_note += "" if g.dropout else ", without the two 1-byte dropout masks"
        fused = fused_attention(t, s)
        scores = s.recompute == "none" and not fused
        form = f"{sbh} x ({lin:.4g}{mlp_note}" + (f" + 5as/h, 5as/h = {5 * g.heads * sq / g.hidden:.4g}"
                                                  if scores else "") + f") bytes / tp {s.tp}" \
            + ((" (fused attention: no score matrix stored, no recompute)" if t.flash_attention else
                " (ring attention under cp runs fused kernels: no score matrix stored, no recompute)")
               if s.recompute == "none" and fused else "") \
            + (f" (selective recompute: the score matrix, s x b x h x 5as/h with 5as/h = "
                 f"{5 * g.heads * sq / g.hidden:.4g}, is recomputed, not stored)"
               if s.recompute == "selective" else "")
    scale = t.bytes["act"] / 2
    logits, working = parts["logits"], parts["working"]
    last = {"1f1b": " (1F1B: it holds one micro-batch)", "gpipe": "",
            "interleaved": " (interleaved: its warm-up's chunk forwards)"}[s.schedule]
    where = {"first": " on the first stage", "last": " on the last stage" + last, "only": ""}.get(
        parts["stage"], f" on pipeline {parts['stage']} (more layers than the first stage's, 2(p-1-r) fewer "
                        f"warm-up chunk forwards: stages.stage_inflight)")
    how = inflight_arithmetic(p, parts["stage"])
    total, r = parts["total"], p.memory.peak_rank
    if r is not None:   # deferred gradient sync: the rank and moment memory.deferred_peak takes (grad_sync.peak)
        logits, pipe = p.memory.peak_loss, p.memory.pipeline
        total, how = p.memory.activations, ""
        layers = round((total - working - logits - pipe) / per, 6)
        where = (f" on pipeline rank {r}, at its peak of activations + gradients (pp_grad_sync {t.pp_grad_sync}: "
                 f"the grad_sync line; grad_sync.peak walks stages.schedule_order)")
        if pipe:
            where += (f" + torch's pipelining buffers {gib(pipe)} (a receive buffer per micro-batch, the outputs "
                      f"and inputs' gradients it keeps: memory.pipeline_buffers, runtime {t.runtime})")
    return (f"Activations: {form}{f' x {scale:g} ({t.precision})' if scale != 1 else ''} = {gib(per)} per layer "
            f"x {layers:.4g} layers in flight{where}{how}"
            + (f" + the recomputed layer's working set {gib(working)} (its bytes without the score matrix, "
               f"held during its backward)" if working else "")
            + (f" + fp32 logits 4 x s x b x V / tp = 4 x {sq} x {s.micro_batch} x {g.vocab} / {s.tp} = {gib(logits)}"
               if logits and loss_bytes(t, s.tp) == FUSED_LOSS_BYTES else "")
            + (f" + the unfused loss's fp32 log-softmax output and its two gradients, 12 x s x b x V / tp = 12 x {sq} x "
               f"{s.micro_batch} x {g.vocab} / {s.tp} = {gib(logits)}" if logits and loss_bytes(t, s.tp) == UNFUSED_LOSS_BYTES
               else "")
            + (f" + torch's loss_parallel backward (the fp32 log-softmax, its zeros, exp and their sum), 16 x s x b x V "
               f"/ tp = 16 x {sq} x {s.micro_batch} x {g.vocab} / {s.tp} = {gib(logits)}"
               if logits and loss_bytes(t, s.tp) == LOSS_PARALLEL_BYTES else "")
            + f" = {gib(total)}.")


def inflight_arithmetic(p: Plan, stage: str) -> str:
    """Where the first stage's layers in flight come from (Korthikanti et al. 2022, Section 4.2.3)."""
    s = p.strategy
    if s.pp == 1 or stage != "first" or not p.stage_layers:
        return ""
    if s.schedule == "gpipe":
        return f" (GPipe: {p.grad_accum} micro-batches x {p.stage_layers[0]} layers)"
    if s.schedule != "interleaved":
        return f" (1F1B: {min(s.pp, p.grad_accum)} micro-batches x {p.stage_layers[0]} layers)"
    # the warm-up simulation stages.stage_inflight runs (Korthikanti et al.'s 1 + (p-1)/(p x v) only for equal
    # chunks and many micro-batches)
    g, m, v = p.model.gpt, p.grad_accum, s.virtual
    held = chunks(g, s.pp, v, s.stage_layers)[0]
    rnd = m // rounds(m, s.pp)
    n = min(m * v, (v - 1) * rnd + 2 * (s.pp - 1) + 1)
    warm = sum(held[(j // rnd) % v] for j in range(n))
    grow = ("" if warm >= stage_inflight(held, s.pp, m, 0) else f", {warm} layers; the steady state's forwards "
            f"on larger chunks pair with backwards on smaller ones (stages.schedule_order) up to the peak")
    return (f" (interleaved 1F1B: min(m x v, (v-1) x round + 2(p-1) + 1) = min({m} x {v}, {v - 1} x {rnd} + "
            f"2 x {s.pp - 1} + 1) = {n} chunk forwards before the first backward, the j-th on chunk "
            f"(j // {rnd}) mod {v} of {'/'.join(map(str, held))} layers{grow})")


def grad_sync_sentence(p: Plan) -> str:
    """The explain[] line: when the stage's gradients are reduced and what that holds at the memory peak."""
    t, s, mem = p.training, p.strategy, p.memory
    if not deferred(t, s) or p.model.gpt is None or p.model.moe is not None:
        return ""
    by = t.bytes
    gb = grad_reduce_bytes(t.precision, s.zero, by["grad"], t.grad_reduce)
    n, d = reductions(t, s, p.grad_accum), shard_group(s, p.cluster)
    psi = mem.params / by["param"]
    shard = psi * by["grad"] / d
    when = (f"after its last backward of each of the {n} rounds of the interleaved schedule" if n > 1 else
            "after its last backward of the step")
    g = 1024**3
    return (f"Gradient sync under the pipeline (pp_grad_sync {t.pp_grad_sync}): each chunk's gradients accumulate "
            f"unsharded at {gb} B a parameter and are reduce-scattered {when} ({n} call(s) per step, the compute "
            f"waiting for each, as torch's pipelining does); parameters held unsharded, {psi / 1e9:.4g}B x "
            f"{by['param']} B = {mem.params / g:.3g} GiB. At the busiest rank's (pipeline rank {mem.peak_rank}) peak "
            f"of activations + gradients: "
            f"activations {mem.activations / g:.3g} GiB + the live chunks' gradients {(mem.grads - shard) / g:.3g} "
            f"GiB (of {psi * gb / g:.3g} GiB for the whole stage) + their shard {psi / 1e9:.4g}B x {by['grad']} B / "
            f"{d} = {shard / 2**20:.4g} MiB: grads {mem.grads / g:.3g} GiB.")
