"""Expert parallelism (``parallel.ep``): a mixture of experts' experts split over ep ranks carved out of dp.

    ep = apply_ep(model, dims.build_ep_mesh("cpu"), dims)     # parallelize() does this for parallel.ep > 1
    ...forward / backward...                                   # dispatch and combine by all-to-all
    ep.sync_grads()                                            # ddp: the expert gradients over their own group

The mesh (``ParallelDims.build_ep_mesh``): dp split into (edp, ep), ep innermost, so the ep ranks are
consecutive data ranks (tp x cp apart, the planner's layout). Each MoE block's stacked expert weights
(``GroupedExperts``: (experts, h, ffn) ...) become DTensors sharded by expert, ``Shard(0)`` on the ep mesh:
rank i of an ep group holds experts [i x E/ep, (i+1) x E/ep). The checkpoint, the full state dict and the
materializer read them as any DTensor, so a run's weights and its DCP checkpoint name the same full
tensors as one process's.

A forward, per MoE block (GShard's dispatch): every rank routes its own tokens (capacity counted on its
tokens, as one process counts a micro-batch's), fills its (experts, capacity, h) buffer and hands it to
``torch.distributed.all_to_all_single``: the rows of experts i x E/ep ... go to ep rank i, which runs its
experts over what every rank sent (one bmm per expert over ep x capacity rows) and sends the outputs back
by a second all-to-all; the backward does the same two in reverse (``_AllToAll``). That is the planner's
4 calls per MoE block per micro-batch, each moving experts x capacity x h values a rank
(``tandem plan --ep``: micro_batch x seq x top_k x capacity_factor x h; terms/expert.py). In evaluation
the capacities differ from rank to rank (nothing is dropped), and each all-to-all takes the split sizes
the ranks exchange first.

Gradients: the non-expert parameters are replicated over dp and averaged there (DDP, FSDP on the dp
mesh). An expert's gradient on its owner already sums the contributions of its whole ep group's tokens
(the all-to-all's backward brought them), so the edp ranks (dp / ep, holding the same experts) sum theirs
and everything is divided by dp, not dp / ep: under ddp by ``sync_grads`` (the expert weights are left out
of DDP), under zero2 / zero3 by FSDP2 on the edp mesh with its gradient divide factor set to dp
(torchtitan's choice), its shards cut along the hidden dimension so that they do not stack on the ep
ranks' Shard(0).

With tp tp splits the attention only (the llama's ``layout`` leaves the MoE out of the tp plan): the router
and the experts of a rank are whole, replicated over the tp ranks like the norms, and every tp rank routes
the same tokens (its input is the replicated residual stream; under sequence parallel the stream gathered,
its output cut back to the rank's share: the layout's ``whole``, tandem/train/parallel/tp.py). With ep 1 each tp
rank runs the whole MoE on them. With ep x tp (the ep groups are tp apart: ranks with the same tp
coordinate) the tp ranks of a replica share the work of the experts instead of repeating it: each routes
all the tokens (the same decisions, so capacity and drops are one process's), then tp rank j dispatches
only its share j of every expert's capacity slots (``_TakeSlots``), so each all-to-all carries
experts x capacity / tp x h values, and after the combine the tp ranks all-gather their shares of the
outputs back into the full (experts, capacity, h) buffer (``_GatherSlots``) before weighting them into the
tokens. For the experts the tp ranks are thus more data-parallel ranks: an expert's gradient on a rank
holds its slot share only, and is summed over edp x tp (the ``grad`` group) and divided by dp.

Why replicated experts with deduplicated slots, not experts tp-sharded (w1 / w3 column-, w2 row-wise)
inside the ep group: every tp rank holds every token at the MoE (under sequence parallel too: gathered), so a tp-sharded expert would have every tp
rank dispatch the same buffer, tp x the all-to-all bytes of ``tandem plan --ep --tp`` (which, as
Megatron-core with sequence parallelism, counts s / tp tokens a GPU), or need an all-gather and a
reduce-scatter over tp around each expert on top of the deduplication. Sharding slots keeps the bytes the
planner's, adds one all-gather over tp per all-to-all pair, and leaves the expert weights, the
materializer and the checkpoints exactly as under ep alone (``Shard(0)`` on the ep mesh); the price is the
expert weights' memory, / ep rather than / (ep x tp) under ddp (zero2 / zero3 shard them over edp x tp).

Not supported, refused before launch with one line (tandem/core/experts.py): ep with zero1, hsdp, comm
hooks or local SGD, ep with pp; a mixture of experts with cp or compile (under pp with ep 1 it trains:
tandem/train/parallel/pp.py carries each stage's router losses).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from tandem.models.moe import GroupedExperts, moe_layers

EXPERT_WEIGHTS = ("w1", "w2", "w3")


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with its backward: the gradient rows go back the way the rows came."""

    @staticmethod
    def forward(ctx, x, ep: "ExpertParallel", out_splits, in_splits):
        ctx.ep, ctx.splits = ep, (out_splits, in_splits)
        return ep.all_to_all(x, out_splits, in_splits)

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        return ctx.ep.all_to_all(g.contiguous(), in_splits, out_splits), None, None, None


def _slot_sizes(cap: int, tp: int) -> list[int]:
    """Each tp rank's share of an expert's ``cap`` slots: ``torch.tensor_split``'s (the first ones one more)."""
    return [cap // tp + (1 if j < cap % tp else 0) for j in range(tp)]


def _gather_slots(x: torch.Tensor, ep: "ExpertParallel", sizes: list[int]) -> torch.Tensor:
    """(experts, sizes[tp_rank], h) of every tp rank -> (experts, sum(sizes), h), rank order (padded to the
    largest share: gloo's all_gather takes equal sizes)."""
    most = max(sizes)
    pad = x if x.shape[1] == most else torch.cat([x, x.new_zeros(x.shape[0], most - x.shape[1], x.shape[2])], 1)
    parts = [torch.empty_like(pad) for _ in range(ep.tp)]
    dist.all_gather(parts, pad.contiguous(), group=ep.tp_group)
    return torch.cat([part[:, :n] for part, n in zip(parts, sizes)], dim=1)


class _TakeSlots(torch.autograd.Function):
    """Forward: this tp rank's share of the slots of a buffer every tp rank holds alike. Backward: the
    buffer's gradient is every tp rank's share of it, all-gathered (each rank's covers its slots only)."""

    @staticmethod
    def forward(ctx, buf, ep: "ExpertParallel", sizes):
        ctx.ep, ctx.sizes = ep, sizes
        off = sum(sizes[:ep.tp_rank])
        return buf[:, off:off + sizes[ep.tp_rank]].contiguous()

    @staticmethod
    def backward(ctx, g):
        return _gather_slots(g, ctx.ep, ctx.sizes), None, None


class _GatherSlots(torch.autograd.Function):
    """Forward: the tp ranks' shares of the experts' outputs, all-gathered into the full buffer. Backward:
    this rank's share of the gradient (it is the same on every tp rank: the loss is replicated over tp)."""

    @staticmethod
    def forward(ctx, x, ep: "ExpertParallel", sizes):
        ctx.ep, ctx.sizes = ep, sizes
        return _gather_slots(x, ep, sizes)

    @staticmethod
    def backward(ctx, g):
        ep, sizes = ctx.ep, ctx.sizes
        off = sum(sizes[:ep.tp_rank])
        return g[:, off:off + sizes[ep.tp_rank]].contiguous(), None, None


class ExpertParallel:
    """The ep, edp and tp groups of this rank, the dispatch / combine of ``GroupedExperts``, and the bytes."""

    def __init__(self, mesh, dp: int):
        self.mesh, self.dp = mesh, dp
        self.group, self.edp_group = mesh["ep"].get_group(), mesh["edp"].get_group()
        self.ep, self.edp = dist.get_world_size(self.group), dist.get_world_size(self.edp_group)
        self.tp = mesh["tp"].size()
        self.tp_group = mesh["tp"].get_group() if self.tp > 1 else None
        self.tp_rank = mesh["tp"].get_local_rank() if self.tp > 1 else 0
        # the ranks holding the same experts and sharing their gradient: edp, times tp (slot shares)
        self.grad_mesh = mesh["edp", "tp"]._flatten("edp_tp") if self.tp > 1 else mesh["edp"]
        self.grad_group = self.grad_mesh.get_group()
        self.grad_size = dist.get_world_size(self.grad_group)
        self.params: list[nn.Parameter] = []
        self.calls, self.bytes, self.per_call = 0, 0, set()   # all-to-alls this rank made, payload bytes

    def all_to_all(self, x: torch.Tensor, out_splits, in_splits) -> torch.Tensor:
        x = x.contiguous()
        rows = sum(out_splits) if out_splits is not None else x.shape[0]
        out = x.new_empty((rows,) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x, out_splits, in_splits, group=self.group)
        n = x.numel() * x.element_size()
        self.calls, self.bytes = self.calls + 1, self.bytes + n
        self.per_call.add(n)
        return out

    def _capacities(self, cap: int, device) -> list[int]:
        t = torch.tensor([cap], dtype=torch.int64, device=device)
        out = [torch.empty_like(t) for _ in range(self.ep)]
        dist.all_gather(out, t, group=self.group)
        return [int(c) for c in out]

    def run(self, experts: GroupedExperts, buf: torch.Tensor) -> torch.Tensor:
        """buf (experts, capacity, h) of this rank's tokens -> the experts' outputs, the same shape. Under tp:
        this tp rank's share of the slots goes out, the shares come back together (module docstring)."""
        if self.tp > 1:
            sizes = _slot_sizes(buf.shape[1], self.tp)
            out = self._run(experts, _TakeSlots.apply(buf, self, sizes))
            return _GatherSlots.apply(out, self, sizes)
        return self._run(experts, buf)

    def _run(self, experts: GroupedExperts, buf: torch.Tensor) -> torch.Tensor:
        e, cap, h = buf.shape
        local = e // self.ep
        dev = buf.device.type
        if torch.is_autocast_enabled(dev):   # the experts compute in the autocast dtype: send it (half the bytes)
            buf = buf.to(torch.get_autocast_dtype(dev))
        # training: every rank's micro-batch has as many tokens, so the same capacity (equal splits; under tp
        # the ep group's ranks share one tp coordinate, so the same slot share too)
        caps = [cap] * self.ep if experts.training else self._capacities(cap, buf.device)
        equal = len(set(caps)) == 1
        recv_rows, send_rows = [local * c for c in caps], [local * cap] * self.ep
        splits = (None, None) if equal else (recv_rows, send_rows)
        recv = _AllToAll.apply(buf.reshape(e * cap, h), self, *splits)
        # from source s: its rows for my experts, (local, caps[s], h); my experts take them side by side
        x = torch.cat([r.view(local, c, h) for r, c in zip(recv.split(recv_rows), caps)], dim=1)
        y = experts.compute(x)
        back = torch.cat([part.reshape(-1, h) for part in y.split(caps, dim=1)])
        out = _AllToAll.apply(back, self, *((None, None) if equal else (send_rows, recv_rows)))
        return out.view(e, cap, h)

    def most(self, n: int, device) -> int:
        """The largest ``n`` over the ep group (the evaluation's sample counts: every rank runs as many forwards)."""
        t = torch.tensor([n], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t)

    @torch.no_grad()
    def sync_grads(self) -> None:
        """ddp: sum each expert gradient over the edp x tp ranks (the same experts) and divide by dp."""
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in self.params
                 if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        if self.grad_size > 1:
            dist.all_reduce(flat, group=self.grad_group)
        flat /= self.dp
        off = 0
        for g in grads:
            g.copy_(flat[off:off + g.numel()].view_as(g))
            off += g.numel()

    def take_bytes(self) -> dict:
        """The all-to-alls since the last call: calls and payload bytes of this rank (then reset)."""
        out = {"ep_all_to_all_calls": self.calls, "ep_all_to_all_bytes": self.bytes,
               "ep_all_to_all_bytes_per_call": sorted(self.per_call)}
        self.calls, self.bytes, self.per_call = 0, 0, set()
        return out


def apply_ep(model: nn.Module, mesh, dims) -> ExpertParallel:
    """Shard every ``GroupedExperts``' weights by expert over ``mesh["ep"]`` (on meta, before FSDP and the
    materializer) and point it at one ``ExpertParallel``."""
    ep = ExpertParallel(mesh, dims.dp)
    for m in model.modules():
        if isinstance(m, GroupedExperts):
            for name in EXPERT_WEIGHTS:
                p = getattr(m, name)
                d = nn.Parameter(distribute_tensor(p.data, mesh["ep"], [Shard(0)], src_data_rank=None),
                                 requires_grad=p.requires_grad)
                setattr(m, name, d)
                ep.params.append(d)
            m.expert_parallel = ep
    return ep


def expert_modules(model: nn.Module) -> list[GroupedExperts]:
    return [m for m in model.modules() if isinstance(m, GroupedExperts)]


def ddp_ignore(model: nn.Module, ep: ExpertParallel) -> None:
    """Leave the expert weights out of DDP (its broadcast and its all-reduce): ``sync_grads`` reduces them."""
    mine = {id(p) for p in ep.params}
    names = [n for n, p in model.named_parameters() if id(p) in mine]
    nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)


def shard_experts(model: nn.Module, ep: ExpertParallel, reshard: bool) -> None:
    """zero2 / zero3: FSDP2 units of the experts on the edp (x tp) mesh (before the blocks' units on dp),
    their gradients divided by dp; shards along the hidden dimension (dim 1), apart from ep's Shard(0)."""
    from torch.distributed.fsdp import fully_shard

    for m in expert_modules(model):
        fully_shard(m, mesh=ep.grad_mesh, reshard_after_forward=reshard, shard_placement_fn=lambda p: Shard(1))
        m.set_gradient_divide_factor(float(ep.dp))
        # gloo has no PREMUL_SUM: sum, then divide by dp. Not on a 1-rank group (dp = ep, tp 1), where
        # FSDP2 (torch 2.13) skips the collective and divides by the factor both in its copy and after it
        if ep.grad_size > 1 and dist.get_backend(ep.grad_group) == "gloo":
            m.set_force_sum_reduction_for_comms(True)


def step_record(par, ctx) -> dict:
    """The step's routing, over every rank (collective when the model has MoE blocks): assignments routed to
    each expert (all blocks, before capacity), the dropped fraction, the mean router loss per block and
    micro-batch; and the all-to-alls of this rank. {} for a dense model."""
    layers = moe_layers(par.root)
    if not layers:
        return {}
    from tandem.train import runtime as rt

    routed = None
    for m in layers:
        if m.routed is not None:
            routed = m.routed.clone() if routed is None else routed + m.routed
    n = len(routed) if routed is not None else layers[0].experts_n
    vals = (routed.tolist() if routed is not None else [0] * n) + [
        sum(m.dropped for m in layers), sum(m.assigned for m in layers), sum(m.aux_sum for m in layers),
        sum(m.forwards for m in layers)]
    for m in layers:
        m.reset_stats()
    rep = par.dims.tp   # the tp ranks of a replica route the same tokens (routing is replicated over tp): once
    tot = [v / rep for v in rt.all_reduce_sum([float(v) for v in vals], ctx)]
    dropped, assigned, aux, forwards = tot[n:]
    out = {"moe_tokens_per_expert": [int(v) for v in tot[:n]],
           "moe_dropped_frac": dropped / assigned if assigned else 0.0,
           "moe_aux_loss": aux / forwards if forwards else 0.0}
    if par.ep is not None:
        out.update(par.ep.take_bytes())
    return out
