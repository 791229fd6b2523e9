"""Pipeline parallelism on ``torch.distributed.pipelining``: split, stages, schedules.

The layers are split into ``pp x virtual`` contiguous stages balanced by estimated cost
(forward FLOPs per token of each block, plus the output layer on the last stage: with a
large vocabulary the last stage gets fewer blocks), or into equal layer counts
(``pp_split=even``). Rank r of the pp group owns stages r, r+pp, ... (interleaved
1F1B's loop placement; one stage per rank otherwise). Each rank keeps a skeleton of the
decoder with only its blocks (and the embeddings on the first stage, the norm and head on the
last, the position tables on all: the model's ``layout``, ``tandem/models/layout.py``), so
parameter names match the full model and checkpoints reshard across pp degrees. A decoder
states each part's cost as ``part_cost("embed" | "block" | "head")``.

A mixture of experts' router losses (``tandem/models/moe.py``) are made in every stage, but only the last
stage computes the loss: each stage adds its own blocks' router losses to the backward at its output
(``_WithRouterLoss``, Megatron-core's MoEAuxLossAutoScaler idea) with the weight the loss gives them
without pp (the micro-batch's scored targets / the step's, times the loss scale), and the values are summed
over the pp group into the logged loss (``RouterLosses``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from tandem.models.moe import MoE, router_loss

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}


def balanced_split(costs: list[float], stages: int, first: float = 0.0, last: float = 0.0) -> list[int]:
    """Start index of each stage's layers minimising the largest stage cost (exact, by dynamic
    programming over contiguous splits); ``first``/``last`` are fixed costs of the first and last stage."""
    n = len(costs)
    pre = [0.0]
    for c in costs:
        pre.append(pre[-1] + c)
    INF = float("inf")
    # best[s][i]: minimal max cost placing layers[:i] into s stages
    best = [[INF] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            for j in range(s - 1, i):
                c = pre[i] - pre[j] + (first if s == 1 else 0.0) + (last if s == stages else 0.0)
                v = max(best[s - 1][j], c)
                if v < best[s][i] - 1e-12:
                    best[s][i], cut[s][i] = v, j
    starts, i = [], n
    for s in range(stages, 0, -1):
        i = cut[s][i]
        starts.append(i)
    return starts[::-1]


def split_layers(model: nn.Module, stages: int, how: str) -> list[list[int]]:
    n = len(getattr(model, model.layout.blocks))
    if how == "even":
        starts = [s * n // stages for s in range(stages)]
    else:
        cost = model.part_cost
        starts = balanced_split([cost("block")] * n, stages, cost("embed"), cost("head"))
    bounds = starts + [n]
    return [list(range(bounds[s], bounds[s + 1])) for s in range(stages)]


def describe_split(model: nn.Module, parts: list[list[int]]) -> str:
    out = []
    for s, ids in enumerate(parts):
        cost = len(ids) * model.part_cost("block") + (model.part_cost("head") if s == len(parts) - 1 else 0)
        extra = ("+emb" if s == 0 else "") + ("+head" if s == len(parts) - 1 else "")
        out.append(f"stage {s}: layers {ids[0]}-{ids[-1]}{extra} ({cost / 1e6:.3g} MFLOP/token)")
    return "; ".join(out)


class _WithRouterLoss(torch.autograd.Function):
    """Forward: the stage's output as it is. Backward: its gradient, and ``weight`` as the gradient of the
    stage's router loss ``aux`` (what d(loss)/d(aux) is where the loss adds aux x weight)."""

    @staticmethod
    def forward(ctx, out, aux, weight: float):
        ctx.weight, ctx.meta = weight, (aux.shape, aux.dtype, aux.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, g):
        shape, dtype, device = ctx.meta
        return g, torch.full(shape, ctx.weight, dtype=dtype, device=device), None


class RouterLosses:
    """This rank's stages' router losses over one step: each micro-batch's weight (set by the trainer's
    Stepper before the schedule runs), and the weighted values, for the logged loss."""

    def __init__(self, chunks: list["Chunk"]):
        self.chunks, self.weights, self.scale, self.value = chunks, [], 1.0, 0.0

    def start(self, weights: list[float], scale: float) -> None:
        self.weights, self.scale, self.value = weights, scale, 0.0
        for c in self.chunks:
            c.seen = 0

    def attach(self, chunk: "Chunk", out: torch.Tensor) -> torch.Tensor:
        aux = router_loss(chunk)
        if aux is None:
            return out
        # a stage runs its micro-batches' forwards in order, each once (activation checkpointing recomputes
        # inside the blocks, below this): the chunk's count is the micro-batch's index
        w = self.weights[chunk.seen]
        chunk.seen += 1
        self.value += float(aux.detach()) * w
        return _WithRouterLoss.apply(out, aux, w * self.scale)


class Chunk(nn.Module):
    """One pipeline stage: a view on some of the skeleton's modules (shared, not copied), run by the
    model's own forward (which skips the parts a stage does not hold)."""

    def __init__(self, model: nn.Module, ids: list[int], first: bool, last: bool):
        super().__init__()
        lay = model.layout
        self.layout, self._forward = lay, type(model).forward
        for name in lay.embeddings:
            setattr(self, name, getattr(model, name) if first else None)
        for name in lay.shared:
            setattr(self, name, getattr(model, name))
        blocks = getattr(model, lay.blocks)
        setattr(self, lay.blocks, nn.ModuleDict({str(i): blocks[str(i)] for i in ids}))
        for name in lay.final:
            setattr(self, name, getattr(model, name) if last else None)
        # this stage's MoE blocks (a plain list, as the model's: router_loss reads it), and their losses' owner
        self.moe = [b.mlp for b in getattr(self, lay.blocks).values() if isinstance(getattr(b, "mlp", None), MoE)]
        self.router_losses: RouterLosses | None = None
        self.seen, self.inferring = 0, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._forward(self, x)
        if self.router_losses is None or not self.training:
            return out
        if not torch.is_grad_enabled():   # a forward outside the schedule (forward_only): no backward to join
            router_loss(self)
            return out
        if self.inferring:   # the stage's shape inference (placeholder inputs): no loss, no routing counted
            router_loss(self)
            for m in self.moe:
                m.reset_stats()
            return out
        return self.router_losses.attach(self, out)


class _Stage(PipelineStage):
    """A PipelineStage whose chunk knows when a forward is the first step's metadata inference (torch runs
    the stage once on placeholder tensors to learn the shapes it sends), not a micro-batch."""

    def _forward_metadata_inference(self, *args, **kwargs):
        self.submod.inferring = True
        try:
            return super()._forward_metadata_inference(*args, **kwargs)
        finally:
            self.submod.inferring = False


def keep_only(model: nn.Module, parts: list[list[int]], mine: list[int]) -> None:
    """Turn ``model`` into this rank's skeleton: only the blocks of stages ``mine``."""
    lay = model.layout
    owned = {i for s in mine for i in parts[s]}
    blocks = getattr(model, lay.blocks)
    for i in list(blocks.keys()):
        if int(i) not in owned:
            del blocks[i]
    if 0 not in mine:
        for name in lay.embeddings:
            setattr(model, name, None)
    if len(parts) - 1 not in mine:
        for name in lay.final:
            setattr(model, name, None)


def build_schedule(model: nn.Module, parts, mine, pp_rank: int, pp_size: int, group, device, schedule: str,
                   n_micro: int, loss_fn):
    """(schedule, stages, router losses: None for a dense model) of this rank's stages ``mine``."""
    chunks = [Chunk(model, parts[s], s == 0, s == len(parts) - 1) for s in mine]
    router = None
    if any(c.moe for c in chunks) or getattr(model, "moe", None):   # every pp rank joins the logged sum
        router = RouterLosses(chunks)
        for c in chunks:
            c.router_losses = router
    stages = [_Stage(c, s, len(parts), device, group=group) for c, s in zip(chunks, mine)]
    cls = SCHEDULES[schedule]
    if schedule == "interleaved":
        return cls(stages, n_micro, loss_fn=loss_fn, scale_grads=False), stages, router
    return cls(stages[0], n_micro, loss_fn=loss_fn, scale_grads=False), stages, router


def stage_ids(pp_rank: int, pp_size: int, virtual: int) -> list[int]:
    return [pp_rank + k * pp_size for k in range(virtual)]


def step(schedule, x: torch.Tensor, y: torch.Tensor, has_first: bool, has_last: bool) -> list[torch.Tensor]:
    losses: list = []
    args = (x,) if has_first else ()
    kw = dict(target=y, losses=losses) if has_last else {}
    schedule.step(*args, **kw)
    return losses


def forward_only(par, x: torch.Tensor) -> torch.Tensor | None:
    """Output of ``x`` through this pp group's stages, in stage order, on the rank that holds the last
    stage (None on the others): evaluation without the schedule, whose micro-batch shapes are fixed
    at the first training step. Each stage's output goes to the next stage's rank (stage s lives on
    pp rank s % pp); the receiver learns its shape from a small header. The hidden states travel in
    fp32, the dtype of the residual stream under autocast too (embeddings and the residual adds are fp32)."""
    import torch.distributed as dist

    group, pp_size = par.mesh["pp"].get_group(), par.dims.pp
    mine = {s.stage_index: s.submod for s in par.stages}
    n = par.stages[0].num_stages
    h, out = x, None
    for s in range(n):
        if s not in mine:
            continue
        if s > 0:
            head = torch.empty(5, dtype=torch.int64, device=x.device)
            dist.recv(head, group=group, group_src=(s - 1) % pp_size)
            h = torch.empty(head[1:1 + int(head[0])].tolist(), dtype=torch.float32, device=x.device)
            dist.recv(h, group=group, group_src=(s - 1) % pp_size)
        h = mine[s](h)
        if s == n - 1:
            out = h
            continue
        t = h.to_local() if hasattr(h, "to_local") else h  # tp: the local part, as the schedule sends it
        t = t.detach().float().contiguous()
        head = torch.tensor([t.dim(), *t.shape] + [0] * (4 - t.dim()), dtype=torch.int64, device=x.device)
        dist.send(head, group=group, group_dst=(s + 1) % pp_size)
        dist.send(t, group=group, group_dst=(s + 1) % pp_size)
    return out
