"""When sharded gradients are reduced under a pipeline (``Training.pp_grad_sync``), and what that holds in memory.

- ``microbatch`` (the default): ZeRO-2/3 keep gradients sharded, so every micro-batch's backward reduce-scatters
  the stage's gradients (data_parallel.dp_ops: ``mb`` calls, each hidden behind its own backward). Memory: the gradients
  / the shard group.
- ``step``: torch.distributed.pipelining (torchtitan's pipeline). Every micro-batch's backward runs with
  ``set_requires_gradient_sync(False)`` (stage.py, ``backward_one_chunk``); FSDP2 then keeps each parameter's
  unsharded gradient, upcast to the reduce dtype and summed over the micro-batches
  (fsdp/_fully_shard/_fsdp_param.py, ``to_accumulated_grad_if_needed`` / ``accumulate_unsharded_grad_if_needed``);
  one REDUCE_GRAD action after a stage's last backward reduce-scatters them once (schedules.py,
  ``_add_reduce_grad``; stage.py, ``perform_reduce_grad``), and its ``_root_post_backward_final_callback`` with
  ``is_last_backward`` makes the compute stream wait for that reduce-scatter (``finalize_backward``): exposed.
  torchtitan builds its pipeline's FSDP with ``reshard_after_forward=False`` (parallelize_llama.py, "to avoid
  per-microbatch all-gathers"), so a ZeRO-3 stage gathers its parameters once a step and holds them unsharded.
- ``round``: as ``step``, but each chunk's accumulated gradients are reduce-scattered after its last backward of
  every round of the interleaved schedule (stages.rounds: max(1, m // p) rounds), so they are held unsharded only
  within a round. Llama 3 (Dubey et al. 2024, §3.3.2) states the three things this is the one reading of: FSDP
  "shards optimizer states and gradients", "FP32 gradient accumulation during backward computation over multiple
  micro-batches" (nothing to accumulate during backward if every micro-batch were reduce-scattered), and the 8k
  rows run in 80 GB without activation checkpointing (which ``step`` does not, by the planner's memory).
Under 1F1B (one chunk a stage) ``round`` is ``step``. MoE models stay per micro-batch (not modelled). tandem's own
trainer refuses ZeRO with pp > 1, so its job specs never plan these modes. Memory under ``step``/``round``: the
chunks' unsharded gradients in the reduce dtype that are live at the rank's peak (``peak``: each allocated at the
chunk's first backward of the step or round, while that backward still holds its activations), + the sharded
gradients, + the parameters unsharded.
"""

from __future__ import annotations

from tandem.plan.inputs.training import Strategy, Training
from tandem.plan.terms.dp_overlap import pipelined
from tandem.plan.terms.stages import rounds, schedule_order

def deferred(t: Training, s: Strategy) -> bool:
    """Sharded gradients accumulated unsharded and reduced per step or round: ZeRO-2/3 with pp > 1."""
    return t.pp_grad_sync in ("step", "round") and s.pp > 1 and s.zero >= 2


def reductions(t: Training, s: Strategy, mb: int) -> int:
    """Reduce-scatters of the stage's gradients per step when ``deferred``: 1, or one a round (interleaved)."""
    return rounds(mb, s.pp) if t.pp_grad_sync == "round" and s.schedule == "interleaved" else 1


def dp_ops(op, t: Training, s: Strategy, defer: bool, buckets: int, gbytes: float, pbytes: float, g, mb: int,
           fwd: float, bwd: float) -> list:
    """ZeRO-1/2 (and ZeRO-3 when ``defer``): the gradients' bucketed reduce-scatter and the parameters' gather,
    built with data_parallel.dp_ops's ``op``; ``fwd`` / ``bwd`` one micro-batch's forward / backward seconds."""
    if defer:   # once a step or round, the compute waiting on it
        rs = op("dp-grad", "reduce_scatter", gbytes, reductions(t, s, mb), g, buckets, "none", 0.0, lambda tm: tm)
    else:   # sharded grads cannot accumulate locally: every micro-batch (ZeRO-2)
        rs = op("dp-grad", "reduce_scatter", gbytes, mb if s.zero == 2 else 1, g, buckets, "buckets", bwd,
                lambda tm: pipelined(tm, buckets, bwd))
    # deferred (FSDP2 under torch's pipelining, ZeRO-2 or 3): gathered at the first forward from FSDP2's all-gather
    # stream, implicitly prefetched behind the previous layer's forward (torch's docs/source/notes/fsdp.rst)
    if t.overlap_param_gather or defer:
        ag = op("dp-params", "all_gather", pbytes, 1, g, buckets, "prefetch", fwd,
                lambda tm: pipelined(tm, buckets, fwd))
    else:
        ag = op("dp-params", "all_gather", pbytes, 1, g, buckets, "none", 0.0, lambda tm: tm)
    return [rs, ag]


def model_state_bytes(t: Training, s: Strategy, psi: float, d: int, reduce_bytes: int) -> tuple[float, float]:
    """(parameter, gradient) bytes per GPU of ``psi`` stage parameters when ``deferred``: parameters unsharded
    (kept from the first forward to the reduction), gradients unsharded in the reduce dtype + their shard."""
    by = t.bytes
    return psi * by["param"], psi * reduce_bytes + psi * by["grad"] / d


def peak(held: tuple[int, ...], pp: int, m: int, rank: int, act_layer: float, grad_layer: float,
         grad_extra: float = 0.0, every: int = 0, fly: tuple[float, ...] = (), keep_f: tuple[float, ...] = (),
         keep_b: tuple[float, ...] = (), at_b: tuple[float, ...] = ()) -> tuple[float, float, float, float]:
    """(activation, gradient, pipeline, at_b) bytes at rank ``rank``'s peak of their sum when gradients are accumulated
    unsharded: a chunk's buffer (``grad_layer`` a layer, + ``grad_extra`` on chunk 0 of the first rank or the
    last chunk of the last: embedding, output layer) is allocated at its first backward and held until it is
    reduced, after its last backward of the step (``every`` 0) or after every ``every`` backwards (a round),
    while that backward still holds its activations; ``act_layer`` a layer per micro-batch. Per chunk, the
    pipeline's own tensors (memory.pipeline_buffers): ``fly`` bytes held from a micro-batch's forward to its
    backward, ``keep_f`` from its forward and ``keep_b`` from its backward to the step's end (counted in the
    activations; the third number is their share at the peak); ``at_b`` bytes live only during a backward of the
    chunk (the last stage's loss; in the activations, the fourth number where the peak is such a backward)."""
    v, act, grads, pipe, best = len(held), 0.0, 0.0, 0.0, (0.0, 0.0, 0.0, 0.0)
    fly, keep_f, keep_b, at_b = (x or (0.0,) * v for x in (fly, keep_f, keep_b, at_b))
    done = [0] * v
    extra_chunk = 0 if rank == 0 else v - 1 if rank == pp - 1 else -1
    size = [held[c] * grad_layer + (grad_extra if c == extra_chunk else 0.0) for c in range(v)]
    for kind, c in schedule_order(v, pp, m, rank):
        if kind == "F":
            act += held[c] * act_layer + fly[c] + keep_f[c]
            pipe += fly[c] + keep_f[c]
        elif done[c] % (every or m) == 0:
            grads += size[c]
        now = at_b[c] if kind == "B" else 0.0
        if act + now + grads > best[0] + best[1]:
            best = (act + now, grads, pipe, now)
        if kind == "B":
            act += keep_b[c] - held[c] * act_layer - fly[c]
            pipe += keep_b[c] - fly[c]
            done[c] += 1
            if every and done[c] % every == 0:
                grads -= size[c]
    return best
