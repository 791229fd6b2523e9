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
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(self, x)


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
    stages = [PipelineStage(Chunk(model, parts[s], s == 0, s == len(parts) - 1), s, len(parts), device,
                            group=group) for s in mine]
    cls = SCHEDULES[schedule]
    if schedule == "interleaved":
        return cls(stages, n_micro, loss_fn=loss_fn, scale_grads=False), stages
    return cls(stages[0], n_micro, loss_fn=loss_fn, scale_grads=False), stages


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
