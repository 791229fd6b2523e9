"""Memory per GPU: model states (ZeRO paper), activations (Korthikanti et al. 2022), other.

Model states per GPU, with Psi' = params / (tp * pp) and the ZeRO shard group size d:
    params     = Psi' * param_bytes / (d if zero >= 3)
    grads      = Psi' * grad_bytes  / (d if zero >= 2)
    optimizer  = Psi' * K           / (d if zero >= 1)
K = master copy + states: 12 for mixed-precision Adam, so 2 + 2 + 12 = 16 bytes/param
(Rajbhandari et al., "ZeRO", 2020, section 3.1).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from tandem.plan.inputs.hardware import Cluster
from tandem.plan.inputs.model import ModelStats, MoEShape, expert_params, mlp_act_coeff, moe_params
from tandem.plan.inputs.runtime import RUNTIMES
from tandem.plan.inputs.training import Strategy, Training, fused_attention
from tandem.plan.terms.collectives import grad_reduce_bytes
from tandem.plan.terms.fsdp_copies import units as fsdp_units
from tandem.plan.terms.grad_sync import deferred, model_state_bytes, peak, reductions
from tandem.plan.terms.params import expert_shard_group, expert_states, expert_tp, shard_group
from tandem.plan.terms.stages import (busiest_stage_params, chunks, chunks_of, first_stage_inflight, max_stage_params,
                                      split, stage_inflight, stage_params)

CONTEXT_BYTES = 1.0 * 1024**3   # CUDA context, cuBLAS/cuDNN workspaces, allocator slack (rough)
# The loss's logits per element (token x vocabulary entry / tp) at its peak, the start of backward:
# - fused (Megatron's vocab-parallel cross-entropy, Transformer Engine, a compiled loss): the FP32 logits,
#   4 B (Korthikanti et al. 2022, eq. 3);
# - unfused, torch's F.cross_entropy(logits.float()) as torchtitan's train.py (9dec370) and tandem's trainer run it:
#   log_softmax's FP32 output (saved for backward), then in backward nll_loss's FP32 gradient of it and
#   log_softmax's FP32 gradient of its input, 4 B each, all alive at once: 12 B (the 16-bit logits are freed
#   before backward, torchtitan's `del pred`; the forward's own peak, 2 + 4 + 4 B, is lower).
# - unfused under tp with torch's loss_parallel (torchtitan's and tandem's default; runtime.py): the logits stay
#   sharded over the vocabulary and DTensor's handlers run the loss. Its backward
#   (torch/distributed/tensor/parallel/loss.py, _nll_loss_and_log_softmax_backward, the same from torch 2.3 to 2.13)
#   returns (zeros_like(x) + exp(x)) * grad_output with x the saved FP32 log-softmax: x, the zeros, exp(x) and
#   their sum (then the product) alive at once, 16 B (its forward: 2 + 4 + shifted 4 + exp 4 = 14 B). Measured on
#   CPU, live storages under a dispatch mode at world 2: 12.0 B native, 16.0 B loss_parallel
#   (tests/plan/terms/test_memory.py).
FUSED_LOSS_BYTES, UNFUSED_LOSS_BYTES, LOSS_PARALLEL_BYTES = 4, 12, 16


def loss_bytes(t: Training, tp: int = 1) -> int:
    """Bytes per logit element at the loss's peak: the fused-loss rule bandwidth_bound.layer_ops times it by."""
    fused = t.kernels != "eager" if t.fused_loss is None else t.fused_loss
    if fused:
        return FUSED_LOSS_BYTES
    return LOSS_PARALLEL_BYTES if tp > 1 and RUNTIMES[t.runtime].loss_parallel else UNFUSED_LOSS_BYTES


@dataclass
class Memory:
    params: float
    grads: float
    optimizer: float
    activations: float
    other: float
    capacity: float
    notes: list[str]
    peak_rank: int | None = None   # under deferred gradient sync: the pipeline rank whose activations + gradients peak
    reserve: float = 0.0           # --allocator-reserve: the caching allocator's cache beyond the tensors' peak
    pipeline: float = 0.0          # of activations, under deferred sync: torch pipelining's buffers (pipeline_buffers)
    peak_loss: float = 0.0         # of activations, under deferred sync: the loss's bytes, where live at the peak

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.other + self.reserve

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity


def gpt_layer_act_bytes(m: ModelStats, s: Strategy, t: Training, b: int, recompute: str | None = None) -> float:
    """Activation bytes of one transformer layer for one micro-batch of b sequences.

    Korthikanti et al. 2022, Table 2, with sequence parallelism (assumed whenever tp > 1):
    s*b*h*(34/t + 5*a*s/(h*t)) at 16-bit; generalised here: attention 7 + 4*kv/heads (11 for MHA),
    MLP 3 + 4*ffn/h (19 for ffn = 4h; 3 + 6*ffn/h gated), layer norms 4; without dropout the two 1-byte masks
    (one in the attention's 7, one in the MLP's 3) go. Selective recompute drops the
    5*a*s/h term (what FlashAttention also avoids); full recompute keeps only the layer input, 2*s*b*h/t.
    """
    rc = recompute or s.recompute
    return _layer_act_bytes(m.gpt, m.moe, t.bytes["act"], fused_attention(t, s), s.tp, s.cp, b, rc, op_sac(t, m))


def op_sac(t: Training, m: ModelStats) -> bool:
    """Selective recompute is torchtitan's per-op policy (its runtime; a dense model's layers), not Korthikanti's."""
    return t.runtime == "torchtitan" and m.moe is None


@lru_cache(maxsize=65536)   # pure in hashable values (frozen shapes): the search asks for each many times
def _layer_act_bytes(g, moe, act_bytes: int, fused: bool, tp: int, cp: int, b: int, rc: str,
                     sac: bool = False) -> float:
    h, sq, a = g.hidden, g.seq // cp, g.heads   # cp: each GPU holds s/cp tokens
    scale = act_bytes / 2  # the formula counts 2-byte activations and 1-byte masks
    if rc == "full":
        return 2 * sq * b * h / tp * scale
    if rc == "none" and sac and tp > 1:   # torch's TP also saves the two gathered matmul inputs (_torch_tp_gathered)
        return _layer_act_bytes(g, moe, act_bytes, fused, tp, cp, b, rc) + _torch_tp_gathered(g, sq, b, tp) * scale
    if rc == "selective" and sac:
        # torchtitan's "selective op" checkpointing (parallelize_llama.py, _save_list, 9dec370): a block keeps its
        # input, SDPA's output (+ its FP32 logsumexp, heads x 4 B a token) and every other matmul's output, counted
        # per block forward: wq (h), wv (kv), w1 (ffn), w2 (h; a row-parallel matmul's partial sum is not / tp);
        # the rest (wk, wo, w3, norms, RoPE, SiLU) is recomputed in backward
        return sq * b * (2 * ((3 * h + g.kv_dim + g.ffn) / tp + h) + 4 * a / tp) * scale   # bytes, as the 34 sbh
    mlp = 3 + (6 if g.gated else 4) * g.ffn / h
    if moe is not None:
        mlp = mlp_act_coeff(moe)
    # the two 1-byte dropout masks (after attention's projection and after the MLP), 1 each in the 7 and the 3:
    # none in a model trained without dropout (Llama 3)
    linear = (7 + 4 * g.kv_heads / g.heads) + mlp + 4 - (0 if g.dropout else 2)
    per = sq * b * h * linear / tp
    if rc == "none" and not fused:   # fused kernels store no score matrix
        per += 5 * a * sq * sq * b / tp
    return per * scale


def _torch_tp_gathered(g, sq: int, b: int, tp: int) -> float:
    """torch's tensor parallel (DTensor ColwiseParallel on sequence-sharded input, torchtitan): the all-gathered inputs
    of the attention's and the MLP's column-parallel matmuls (one tensor each, s x b x h at 2 B) are saved whole for
    their backward, where Megatron's sequence parallelism saves the shard and gathers it again (Korthikanti et al.
    §4.2.2): 2 x 2 x s x b x h x (1 - 1/tp) bytes more a layer that keeps its activations."""
    return 4 * sq * b * g.hidden * (1 - 1 / tp) if tp > 1 else 0.0


def inflight_layers(m: ModelStats, s: Strategy, micro_batches: int) -> float:
    """Layers' worth of activations the first pipeline stage holds at its peak."""
    L, p = m.gpt.layers, s.pp
    if p == 1:
        return L
    if s.schedule == "gpipe":
        return split(m.gpt, p, s.stage_layers, chunks_of(s))[0] * micro_batches
    v = chunks_of(s)
    return first_stage_inflight(chunks(m.gpt, p, v, s.stage_layers)[0], p, micro_batches)


def activation_parts(m: ModelStats, s: Strategy, t: Training, micro_batches: int) -> dict[str, float]:
    """Activation bytes of the stage that holds the most, in parts (explain_memory.py prints them):

    - ``stored``: the per-layer bytes (Korthikanti et al.) x the layers in flight on the first stage;
    - ``working``: with full recompute, the layer being recomputed holds its forward working set while its
      backward runs: the per-layer bytes without the s x s score matrix (34 sbh/t for GPT-3; the recompute
      runs a fused attention kernel, which never stores it);
    - ``logits``: the loss's FP32 logits, 4 x s x b x V / tp (Korthikanti et al. eq. 3), on the last stage;
    - with a pipeline the last stage (its layers x the micro-batches it holds: 1 under 1F1B, all under
      GPipe, + the logits) wins when it holds more than the first; so does a middle rank when the first
      stage has fewer layers than it (Llama 3's 7, 8 x 14, 7): rank r runs 2(p-1-r) fewer warm-up chunk
      forwards than rank 0, but each may hold more layers (stages.stage_inflight, rank by rank).
    """
    return dict(_activation_parts(m.gpt, m.moe, t.bytes["act"], fused_attention(t, s), s.tp, s.cp, s.pp, s.micro_batch,
                                  s.recompute, chunks_of(s), s.schedule == "gpipe", s.stage_layers, micro_batches,
                                  loss_bytes(t, s.tp), op_sac(t, m)))


@lru_cache(maxsize=65536)   # pure: the search asks for the same parts across ZeRO stages and hsdp (callers copy)
def _activation_parts(g, moe, act_bytes: int, fused: bool, tp: int, cp: int, pp: int, b: int, recompute: str, v: int,
                      gpipe: bool, given: tuple[int, ...] | None, micro_batches: int, loss_b: int = FUSED_LOSS_BYTES,
                      sac: bool = False) -> dict:
    per = _layer_act_bytes(g, moe, act_bytes, fused, tp, cp, b, recompute, sac)
    working = _layer_act_bytes(g, moe, act_bytes, fused, tp, cp, b, "selective") if recompute == "full" else 0.0
    if recompute == "selective" and sac:   # the layer in backward holds what it recomputed, besides what it kept
        working = max(0.0, _layer_act_bytes(g, moe, act_bytes, True, tp, cp, b, "none", True) - per)
    elif recompute == "full" and sac:   # its recomputed forward, torch's gathered inputs included
        working = _layer_act_bytes(g, moe, act_bytes, True, tp, cp, b, "none", True)
    logits = loss_b * (g.seq // cp) * b * g.vocab / tp
    if sac:   # torch's TP: the output layer's gathered input, saved for its backward (_torch_tp_gathered's rule)
        logits += _torch_tp_gathered(g, g.seq // cp, b, tp) / 2 * act_bytes / 2
    if pp == 1:
        first = per * g.layers + working
        return {"per_layer": per, "layers": g.layers, "working": working, "logits": logits, "stage": "only",
                "total": first + logits}
    # inflight_layers and the last and middle ranks' counts, from one split
    if gpipe:
        counts = split(g, pp, given, v)
        layers, last_layers = counts[0] * micro_batches, counts[-1] * micro_batches
    else:   # 1F1B: one micro-batch; interleaved: its warm-up's chunk forwards (stages.stage_inflight)
        held = chunks(g, pp, v, given)
        layers = first_stage_inflight(held[0], pp, micro_batches)
        last_layers = stage_inflight(held[-1], pp, micro_batches, pp - 1)
    first = per * layers + working
    out = {"per_layer": per, "layers": layers, "working": working, "logits": 0.0, "stage": "first", "total": first}
    last = per * last_layers + working + logits
    if last > first:
        out.update(layers=last_layers, logits=logits, total=last, stage="last")
    if not gpipe and 2 < pp:
        r, mid = _middle_inflight(held, pp, micro_batches)
        if per * mid + working > out["total"]:
            out.update(layers=mid, logits=0.0, total=per * mid + working, stage=f"rank {r}")
    return out


@lru_cache(maxsize=65536)   # the search asks for the same split and micro-batch count across ZeRO stages and hsdp
def _middle_inflight(held: tuple[tuple[int, ...], ...], pp: int, micro_batches: int) -> tuple[int, float]:
    # of the ranks with the same chunks the first holds the most (2 warm-up chunk forwards more than the next)
    firsts = {held[r]: r for r in range(pp - 2, 0, -1)}.values()
    return max(((r, stage_inflight(held[r], pp, micro_batches, r)) for r in firsts), key=lambda x: (x[1], -x[0]))


def expert_state_bytes(m: ModelStats, c: Cluster, t: Training, s: Strategy) -> dict[str, float]:
    """An MoE model's routed-expert parameter, gradient and optimizer bytes on the busiest GPU: its experts
    (/ ep, / tp too where the runtime splits them: experts_tp), each ZeRO-sharded over the ranks holding the
    same experts (expert_shard_group). Zeros for a dense model."""
    if m.moe is None:
        return {"params": 0.0, "grads": 0.0, "optimizer": 0.0}
    e, de, zero, by = expert_states(m, s, t)[1], expert_shard_group(s, c, t), s.zero, t.bytes
    return {"params": e * by["param"] / (de if zero >= 3 else 1), "grads": e * by["grad"] / (de if zero >= 2 else 1),
            "optimizer": e * t.optimizer_bytes / (de if zero >= 1 else 1)}


def memory(m: ModelStats, c: Cluster, t: Training, s: Strategy, micro_batches: int) -> Memory:
    notes: list[str] = []
    by = t.bytes
    zero, tp, pp = s.zero, s.tp, s.pp   # read once: the search calls this for every candidate
    if m.moe is not None:   # the experts: expert_state_bytes
        psi = expert_states(m, s, t)[0]
    elif m.gpt is not None and pp > 1:   # the stage that holds the most (embedding or output layer)
        psi = busiest_stage_params(m.gpt, pp, s.stage_layers, chunks_of(s)) / tp
    else:
        psi = m.params / (tp * pp)
    d, ex = shard_group(s, c), expert_state_bytes(m, c, t, s)
    params = psi * by["param"] / (d if zero >= 3 else 1) + ex["params"]
    grads = psi * by["grad"] / (d if zero >= 2 else 1) + ex["grads"]
    defer = deferred(t, s) and m.moe is None and m.gpt is not None
    if defer:   # reduced once a step: unsharded until then (grad_sync.py)
        params, grads = model_state_bytes(t, s, psi, d, grad_reduce_bytes(t.precision, zero, by["grad"],
                                                                              t.grad_reduce))
    ob = t.optimizer_bytes
    optim = psi * ob / (d if zero >= 1 else 1) + ex["optimizer"]
    b, peak_rank = s.micro_batch, None
    pipe = live_loss = 0.0
    if defer:   # the rank whose activations + gradients accumulated so far peak highest
        act, grads, peak_rank, pipe, live_loss = deferred_peak(m, t, s, micro_batches, grads - psi * by["grad"] / d)
        grads += psi * by["grad"] / d
    elif m.gpt is not None:
        act = activation_parts(m, s, t, micro_batches)["total"]
    elif m.act_bytes_per_sample_fp32 is not None:
        act = m.act_bytes_per_sample_fp32 * b * by["act"] / 4
        if s.recompute != "none":
            act *= 0.25
            notes.append("recompute on a CNN: activations taken as 1/4 (rough, checkpointed segments)")
    else:
        act = 0.0
        notes.append("activations unknown for a bare --params model: left out of the total")
    other = CONTEXT_BYTES
    if zero >= 3 and d > 1 and not defer and m.gpt is not None and m.moe is None:
        other += fsdp_inflight_bytes(m, t, s, psi)
    elif zero >= 3 and d > 1:   # gathered layer + prefetched next (an MoE layer's experts: / ep, and / tp where the
        # runtime splits them: whole under tandem's); deferred: the stage's parameters are already counted
        # unsharded (params above), nothing gathered per layer
        ep, ltp = (s.ep, expert_tp(t, s)) if m.moe is not None else (1, tp)
        other += 0.0 if defer else 2 * m.largest_layer_params / (ltp * ep) * t.gather_bytes
    elif s.dp > 1:
        other += 2 * t.bucket_bytes if by["grad"] == 4 else 2 * t.bucket_bytes / 2
    # the allocator's reserve as the fraction given (reserved over allocated, minus 1; default 0: no source gives
    # one that holds across workloads), of everything but the CUDA context
    reserve = t.allocator_reserve * (params + grads + optim + act + other - CONTEXT_BYTES)
    return Memory(params, grads, optim, act, other, c.gpu.memory_bytes, notes, peak_rank, reserve, pipe, live_loss)


def fsdp_inflight_bytes(m: ModelStats, t: Training, s: Strategy, psi: float) -> float:
    """ZeRO-3's unsharded buffers at the activation peak (the start of backward), a dense transformer, one FSDP unit
    a block and the root (embeddings, final norm, output layer; fsdp_copies.units), as FSDP2's fully_shard runs:
    - gathered, in the gather dtype: the root, which FSDP2 does not reshard after forward (it is gathered again at
      once for backward), and two blocks: the one computing and the one prefetched;
    - gradients, unsharded, in the stored dtype (fp32 under autocast): the output layer's, made first in backward
      and held until the root's reduce-scatter at the end of backward, and one block's, with its reduce-scatter
      input in the reduce dtype (FSDP2's foreach_reduce copies the block's gradients into it)."""
    g = m.gpt
    _, root = fsdp_units(m, s, psi)
    block = g.layer_params() / s.tp
    stored = t.gather_bytes   # the parameters' dtype as stored, so their gradients' (4 under autocast)
    reduce = grad_reduce_bytes(t.precision, 3, t.bytes["grad"], t.grad_reduce)
    out_layer = g.vocab * g.hidden / s.tp if s.pp == 1 else 0.0   # pp > 1: held by the last stage only (left out)
    return (root + 2 * block) * t.gather_bytes + (out_layer + block) * stored + block * reduce


def deferred_peak(m: ModelStats, t: Training, s: Strategy, micro_batches: int,
                  full: float) -> tuple[float, float, int, float, float]:
    """(activations, unsharded gradients, pipeline rank, torch pipelining's and the loss's shares of the activations)
    at the peak of activations + gradients over the pipeline ranks when gradients are reduced once a step (grad_sync.peak);
    ``full``: the busiest stage's whole unsharded gradient bytes."""
    g = m.gpt
    parts = activation_parts(m, s, t, micro_batches)
    v = chunks_of(s)
    held = chunks(g, s.pp, v, s.stage_layers)
    layers = split(g, s.pp, s.stage_layers, chunks_of(s))
    per_param = full / max_stage_params(g, layers)   # gradient bytes per parameter of a stage (/ tp inside)
    grad_layer, sp = g.layer_params() * per_param, stage_params(g, layers)
    n = reductions(t, s, micro_batches)
    every, best, rank = (micro_batches // n if n > 1 else 0), (0.0, 0.0, 0.0, 0.0), 0
    loss = loss_bytes(t, s.tp) * (g.seq // s.cp) * s.micro_batch * g.vocab / s.tp
    for r in range(s.pp):   # extra: the embedding (first rank), the output layer and final norm (last)
        extra = (sp[r] - layers[r] * g.layer_params()) * per_param
        const, fly, keep_f, keep_b = pipeline_buffers(m, t, s, micro_batches, r)
        # the loss's bytes live during the last stage's backwards only (the last chunk of the last rank)
        at_b = tuple(loss if r == s.pp - 1 and c == v - 1 else 0.0 for c in range(v))
        a, gr, pipe, live = peak(held[r], s.pp, micro_batches, r, parts["per_layer"], grad_layer, extra, every,
                                 fly, keep_f, keep_b, at_b)
        a += const + parts["working"]
        if a + gr > best[0] + best[1]:
            best, rank = (a, gr, pipe + const, live), r
    return best[0], best[1], rank, best[2], best[3]


def pipeline_buffers(m: ModelStats, t: Training, s: Strategy, micro_batches: int,
                     rank: int) -> tuple[float, tuple[float, ...], tuple[float, ...], tuple[float, ...]]:
    """What torch.distributed.pipelining (PipelineStage, its schedules) holds on pipeline rank ``rank`` besides the
    layers' activations, in bytes: (allocated once, and per chunk the bytes a micro-batch holds from its forward to
    its backward, from its forward to the step's end, from its backward to the step's end; grad_sync.peak walks them).
    Chunk c of rank r is stage c x pp + r. At a stage boundary a micro-batch's tensor is b x s/cp x h / tp
    (sequence-sharded under tp: torchtitan's blocks end in RowwiseParallel(output_layouts=Shard(1))), the last
    stage's output its logits, b x s/cp x V / tp (vocabulary-sharded), both in the activations' dtype. stage.py:
    - receive buffers, one per micro-batch, made once (_prepare_forward_infra / _prepare_backward_infra: a
      _RecvInfo buffer from _make_tensor_from_meta for each chunk id) and kept: an activation buffer on every stage
      but the first, a gradient buffer on every stage but the last; the stage's first block saves its input, which
      is that buffer (counted once: taken off the in-flight activations);
    - each micro-batch's output: in fwd_cache until its backward, and in output_chunks to the step's end on the
      last stage (every stage under the runtime's pp_outputs "all": torch before PR #153383);
    - under "all", each input's gradient, left in the receive buffer's .grad by stage_backward until
      clear_runtime_states at the next step (freed once sent since PR #164329)."""
    g, pp, v = m.gpt, s.pp, chunks_of(s)
    rule = RUNTIMES[t.runtime].pp_outputs
    if rule is None:   # not torch's pipelining (runtime.py): not counted
        return 0.0, (), (), ()
    act = t.bytes["act"]
    bound = s.micro_batch * (g.seq // s.cp) * g.hidden / s.tp * act
    logits = s.micro_batch * (g.seq // s.cp) * g.vocab / s.tp * act
    keep_all = rule == "all"
    const, fly, keep_f, keep_b = 0.0, [], [], []
    for c in range(v):
        k = c * pp + rank
        first, last = k == 0, k == v * pp - 1
        out, inb = (logits if last else bound), (0.0 if first else bound)
        const += micro_batches * (inb + (0.0 if last else out))
        keep_f.append(out if keep_all or last else 0.0)
        fly.append((0.0 if keep_all or last else out) - inb)
        keep_b.append(inb if keep_all else 0.0)
    return const, tuple(fly), tuple(keep_f), tuple(keep_b)


def states_per_gpu(m: MoEShape, tp: int, pp: int, ep: int, dp: int, zero: int, by: dict, optimizer_bytes: int) -> dict:
    """Model-state bytes per GPU (even layers per stage), Megatron's expert layout (experts_tp): expert weights
    / (ep x tp x pp), sharded further over the expert-data-parallel group (dp / ep) by ZeRO; everything else
    / (tp x pp), sharded over dp."""
    if dp % ep:
        raise ValueError(f"ep {ep} must divide dp {dp}")
    e = expert_params(m) / (ep * tp * pp)
    rest = (moe_params(m) - expert_params(m)) / (tp * pp)
    edp = dp // ep

    def sharded(x, d, stage):
        return x / d if zero >= stage else x

    return {"params": sharded(e, edp, 3) * by["param"] + sharded(rest, dp, 3) * by["param"],
            "grads": sharded(e, edp, 2) * by["grad"] + sharded(rest, dp, 2) * by["grad"],
            "optimizer": sharded(e, edp, 1) * optimizer_bytes + sharded(rest, dp, 1) * optimizer_bytes,
            "expert_params_per_gpu": e, "dense_params_per_gpu": rest}
