"""ParallelDims: the one owner of the parallel degrees.

It turns a job spec and a world size into degrees (pp x dp_replicate x dp_shard x cp x tp),
validates them before any process starts (every error shows its arithmetic), and,
inside a worker, builds the DeviceMesh everything else slices:

    mesh dims, outermost first:  pp, dp_replicate, dp_shard, cp, tp

tp is innermost so a tp group is consecutive ranks (one node, fast links), then context
parallel (the ranks splitting each sequence, tandem/train/parallel/cp.py), then data
parallel, then pipeline stages outermost (Megatron-LM's order; the planner assumes the
same). ``dp = dp_replicate x dp_shard``; the trainer builds dp_replicate > 1 for hsdp only,
the planner (``tandem.plan``, which reads its degrees from here) also prices hybrid ZeRO-1/2:
sharded inside a node, replicated across (``from_degrees``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import lru_cache

from tandem.core.decoder import DECODERS, ffn_size
from tandem.core.errors import ConfigError
from tandem.core.experts import check_ep

SHARDED = ("zero2", "zero3", "fsdp", "hsdp")    # FSDP2 strategies
STRATEGIES = ("ddp", "zero1") + SHARDED
ZERO_STAGE = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3, "hsdp": 3}
STAGE_NAME = {0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}   # the canonical name of each ZeRO stage


@dataclass(frozen=True)
class ParallelDims:
    world: int
    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    strategy: str = "ddp"
    cp: int = 1     # context parallel: ranks splitting each sequence, next to tp (same batch, same weights)
    ep: int = 1     # expert parallel: carved out of dp, experts split over ep ranks (tandem/train/parallel/expert.py)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def zero(self) -> int:
        """ZeRO stage: 0 replicated (ddp), 1 optimizer state sharded, 2 + gradients, 3 + parameters."""
        return ZERO_STAGE[self.strategy]

    @property
    def hybrid(self) -> bool:
        """Sharded inside a group of dp_shard ranks, replicated across dp_replicate groups (HSDP)."""
        return self.strategy == "hsdp" or self.dp_replicate > 1

    @classmethod
    @lru_cache(maxsize=4096)   # pure (a frozen result): the planner's search builds the same dims thousands of times
    def from_degrees(cls, dp: int, tp: int = 1, pp: int = 1, zero: int = 0, hybrid: bool = False,
                     ranks_per_node: int | None = None, cp: int = 1, ep: int = 1) -> "ParallelDims":
        """Degrees in the planner's terms (a ZeRO stage, hybrid or not) to dims; no spec checks.

        hybrid: the ZeRO stage shards over the dp ranks of one node (``ranks_per_node // (tp x cp)`` of
        them, or the largest divisor of dp below that, as a DeviceMesh needs) and replicates across.
        world = pp x dp x cp x tp (Megatron-core's order, tp innermost, then cp); ep lies inside dp.
        """
        shard = dp
        if hybrid and zero >= 1:
            room = max(1, (ranks_per_node or dp * tp * cp) // (tp * cp))
            shard = max(d for d in range(1, min(dp, room) + 1) if dp % d == 0)
        name = "hsdp" if hybrid and zero == 3 else STAGE_NAME[zero]
        return cls(world=dp * tp * pp * cp, pp=pp, dp_replicate=dp // shard, dp_shard=shard, tp=tp, strategy=name,
                   cp=cp, ep=ep)

    @property
    def names(self) -> tuple[str, ...]:
        return ("pp", "dp_replicate", "dp_shard", "cp", "tp")

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)

    def coords(self, rank: int) -> dict[str, int]:
        """Position of a global rank on the mesh (row-major over ``names``)."""
        out, rest = {}, rank
        for name, size in zip(reversed(self.names), reversed(self.shape)):
            out[name] = rest % size
            rest //= size
        out["dp"] = out["dp_replicate"] * self.dp_shard + out["dp_shard"]
        return out

    def build_mesh(self, device_type: str):
        """(mesh, dp mesh): the DeviceMesh (collective: every rank calls it) and its flattened dp dimension."""
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, self.shape, mesh_dim_names=self.names)
        return mesh, mesh["dp_replicate", "dp_shard"]._flatten("dp")

    def trainer_refusal(self) -> str | None:
        """Why `tandem train` cannot build this layout, from the degrees alone (None: it can). The one list
        both the planner's search (which marks such candidates) and `tandem train --plan` (which refuses
        them) read; the checks that need the model and batch (heads % tp, tied with pp, ...) are
        ``from_spec``'s."""
        z = self.zero
        if self.ep > 1 and max(self.pp, self.cp) > 1:   # tandem/core/experts.py check_ep says why
            return (f"ep {self.ep} with pp {self.pp} cp {self.cp}: the trainer runs a mixture of experts without "
                    "pipeline stages or context parallelism")
        if self.ep > 1 and (self.strategy in ("zero1", "hsdp") or self.dp_replicate > 1):
            return f"ep {self.ep} with {self.strategy}: the trainer runs ep under ddp, zero2 and zero3"
        if self.pp > 1 and z > 0:
            return f"zero {z} with pp {self.pp}: the trainer runs pipeline stages with ddp only"
        if self.strategy == "zero1" and self.tp > 1:
            return f"zero 1 with tp {self.tp}: ZeroRedundancyOptimizer takes plain tensors, not tp's DTensors"
        if self.cp > 1 and self.pp > 1:
            return f"cp {self.cp} with pp {self.pp}: the trainer runs no ring attention inside pipeline stages"
        if self.cp > 1 and self.hybrid:
            return f"cp {self.cp} with hybrid sharding: the trainer shards cp with dp over one flat group"
        if self.dp_replicate > 1 and self.strategy != "hsdp":
            return (f"hybrid zero {z} (sharded over {self.dp_shard}, replicated {self.dp_replicate}x): the trainer's "
                    "hybrid sharding is hsdp (zero 3) only")
        return None

    def build_ep_mesh(self, device_type: str):
        """The expert mesh (collective): dp split into (edp, ep), ep innermost inside dp, so an ep group is
        tp x cp apart as the planner lays it out (terms/expert.py): the ranks of a (pp, edp, ep, cp, tp) grid.
        ``mesh["ep"]`` splits the experts, ``mesh["edp"]`` (dp / ep ranks) holds the same ones, and with tp
        ``mesh["edp", "tp"]`` (flattened) shares their gradients (tandem/train/parallel/expert.py).

        The dims are listed pp, cp, edp, tp, ep (the same ranks, the grid transposed): FSDP2 shards the
        experts over the flattened edp x tp while they are ``Shard(0)`` on ep, and DTensor slices a mesh by
        dims in ascending order only, so edp and tp must lie next to each other and before ep."""
        import torch
        from torch.distributed.device_mesh import DeviceMesh

        grid = torch.arange(self.world).view(self.pp, self.dp // self.ep, self.ep, self.cp, self.tp)
        return DeviceMesh(device_type, grid.permute(0, 3, 1, 4, 2).contiguous(),
                          mesh_dim_names=("pp", "cp", "edp", "tp", "ep"))

    def describe(self) -> str:
        dp = f"dp {self.dp}" + (f" (replicate {self.dp_replicate} x shard {self.dp_shard})"
                                if self.dp_replicate > 1 else "")
        cp = f" x cp {self.cp}" if self.cp > 1 else ""
        ep = f" (ep {self.ep} inside dp)" if self.ep > 1 else ""
        return f"{self.strategy}: pp {self.pp} x {dp}{ep}{cp} x tp {self.tp} = {self.world} ranks"


def _need(cond: bool, message: str, field: str, value, fix: str) -> None:
    if not cond:
        raise ConfigError(message, field=field, value=value, fix=fix)


def from_spec(spec, world: int, local_world: int | None = None, warn: bool = True) -> ParallelDims:
    """Degrees for ``spec`` on ``world`` ranks with ``local_world`` ranks per node; raises ConfigError."""
    p, m = spec.parallel, spec.model
    local_world = local_world or spec.launch.nproc_per_node
    tp, pp, cp = p.tp, p.pp, p.cp
    _need(p.strategy in STRATEGIES, f"{p.strategy!r} is not one of {', '.join(STRATEGIES)}", "parallel.strategy",
          p.strategy, f"set parallel.strategy to one of: {', '.join(STRATEGIES)}")
    _need(tp >= 1 and pp >= 1, f"degrees must be at least 1 (tp {tp}, pp {pp})", "parallel.tp", (tp, pp),
          "give tp >= 1 and pp >= 1")
    _need(world % (tp * pp) == 0, f"tp {tp} x pp {pp} = {tp * pp} does not divide the world size {world} "
          f"({world} % {tp * pp} = {world % (tp * pp)})", "parallel.tp", f"tp={tp} pp={pp}",
          f"choose tp x pp among the divisors of {world}, or change the number of workers")
    if cp != 1:
        _check_cp(spec, world, tp, pp, cp)
    dp = world // (tp * pp * cp)
    check_ep(spec, world, tp, pp, cp, dp)   # model.experts and parallel.ep (tandem/core/experts.py)
    if tp > 1 or pp > 1:
        _need(m.name in DECODERS, f"tensor and pipeline parallelism split transformer blocks; model {m.name!r} "
              f"has none (tp {tp}, pp {pp})", "parallel.tp" if tp > 1 else "parallel.pp", tp if tp > 1 else pp,
              "use model.name=gpt or llama, or tp=1 pp=1 with a data-parallel strategy (ddp, zero1..3, hsdp)")
    if tp > 1:
        kv = m.kv_heads or m.heads
        ffn = ffn_size(m)
        for name, val in (("heads", m.heads), ("kv_heads", kv), ("ffn", ffn), ("vocab", m.vocab)):
            _need(val % tp == 0, f"{name} {val} is not divisible by tp {tp} ({val} % {tp} = {val % tp})",
                  f"model.{name}", val, f"choose tp dividing {name}, or {name} a multiple of {tp}")
        if p.sequence_parallel:
            local = m.seq // cp   # under cp, sequence parallel splits this rank's share of the sequence
            _need(local % tp == 0, f"sequence parallel splits seq {local} over tp {tp} "
                  f"({local} % {tp} = {local % tp})" + (f" (seq {m.seq} / cp {cp})" if cp > 1 else ""),
                  "model.seq", m.seq, f"make seq a multiple of {tp * cp}")
        if warn and tp > local_world:
            warnings.warn(f"tp {tp} spans more than one node ({local_world} ranks per node): every block's "
                          "all-reduce crosses the network; keep tp <= ranks per node", stacklevel=2)
    if pp > 1:
        v = p.pp_virtual if p.pp_schedule == "interleaved" else 1
        stages = pp * v
        _need(not m.tied, f"tied embeddings share one matrix between the first and the last of {pp} stages",
              "model.tied", True, "set model.tied=false with pp > 1")
        if p.pp_split == "even":
            _need(m.layers % stages == 0, f"layers {m.layers} do not split evenly into pp {pp} x {v} chunk(s) = "
                  f"{stages} stages ({m.layers} % {stages} = {m.layers % stages})", "model.layers", m.layers,
                  f"use a multiple of {stages} layers, or parallel.pp_split=cost")
        _need(m.layers >= stages, f"layers {m.layers} < pp {pp} x {v} chunk(s) = {stages} stages: a stage "
              "would hold no block", "model.layers", m.layers, f"use at least {stages} layers or fewer stages")
        mb = spec.schedule.global_batch // max(1, dp * spec.schedule.micro_batch)
        _need(mb >= pp, f"{mb} micro-batch(es) per step (global_batch {spec.schedule.global_batch} / (dp {dp} x "
              f"micro_batch {spec.schedule.micro_batch})) < pp {pp} stages: the pipeline would stall",
              "schedule.micro_batch", spec.schedule.micro_batch,
              f"give at least {pp} micro-batches per step (smaller micro_batch or larger global_batch)")
        if p.pp_schedule == "interleaved":
            _need(mb % pp == 0, f"interleaved 1F1B runs micro-batches in rounds of pp {pp}; {mb} % {pp} = "
                  f"{mb % pp}", "schedule.micro_batch", spec.schedule.micro_batch,
                  f"make the micro-batches per step a multiple of {pp}")
        _need(p.strategy == "ddp", f"strategy {p.strategy!r} with pp {pp} is not supported (data parallel "
              "over pipeline stages all-reduces gradients)", "parallel.strategy", p.strategy,
              "use parallel.strategy=ddp with pp > 1")
    if p.strategy == "zero1":
        _need(tp == 1 and pp == 1, f"zero1 (ZeroRedundancyOptimizer) takes plain tensors; tp {tp} / pp {pp} "
              "give DTensors or stage slices", "parallel.strategy", "zero1",
              "use zero2/zero3 with tp, ddp with pp, or tp=pp=1")
    replicate, shard = 1, dp
    if p.strategy == "hsdp":
        shard = p.dp_shard or max(1, min(dp, local_world // (tp * pp) if local_world >= tp * pp else 1))
        _need(dp % shard == 0, f"dp_shard {shard} does not divide dp {dp} = world {world} / (tp {tp} x pp {pp})",
              "parallel.dp_shard", shard, f"choose dp_shard among the divisors of {dp}")
        replicate = dp // shard
    if p.comm_hook != "none" or p.local_sgd_every:
        what = "comm_hook" if p.comm_hook != "none" else "local_sgd_every"
        _need(p.strategy == "ddp" and tp == 1 and pp == 1, f"{what} works on DDP's gradient buckets "
              f"(strategy {p.strategy}, tp {tp}, pp {pp})", f"parallel.{what}", getattr(p, what),
              "use strategy=ddp with tp=pp=1, or turn it off")
    if cp > 1 and (p.comm_hook != "none" or p.local_sgd_every):
        what = "comm_hook" if p.comm_hook != "none" else "local_sgd_every"
        _need(False, f"{what} with cp {cp} is not supported (the hooks assume gradients averaged over dp "
              "alone)", f"parallel.{what}", getattr(p, what), "turn it off with cp > 1")
    _need(not (p.comm_hook != "none" and p.local_sgd_every), "comm_hook and local SGD both replace DDP's hook",
          "parallel.comm_hook", p.comm_hook, "choose one of them")
    if p.activation_checkpoint == "selective":
        _need(p.ac_every >= 1, f"ac_every must be at least 1, got {p.ac_every}", "parallel.ac_every",
              p.ac_every, "checkpoint one block in N, N >= 1")
    return ParallelDims(world=world, pp=pp, dp_replicate=replicate, dp_shard=shard, tp=tp, strategy=p.strategy,
                        cp=cp, ep=p.ep)


def _check_cp(spec, world: int, tp: int, pp: int, cp: int) -> None:
    """Context parallelism (tandem/train/parallel/cp.py): a decoder whose sequence cuts into 2 x cp chunks,
    cp x tp x pp dividing the world; not with pipeline stages or hsdp. One ConfigError line each."""
    p, m = spec.parallel, spec.model
    _need(cp >= 1, f"cp must be at least 1, got {cp}", "parallel.cp", cp, "give cp >= 1")
    _need(m.name in DECODERS, f"context parallelism splits a decoder's sequence; model {m.name!r} has none "
          f"(cp {cp})", "parallel.cp", cp, "use model.name=gpt or llama, or cp=1")
    _need(m.seq % (2 * cp) == 0, f"cp {cp} cuts each sequence into 2 x cp = {2 * cp} chunks (two per rank, "
          f"load-balanced causal attention); seq {m.seq} does not split ({m.seq} % {2 * cp} = {m.seq % (2 * cp)})",
          "model.seq", m.seq, f"make seq a multiple of {2 * cp}, or choose cp with 2 x cp dividing {m.seq}")
    _need(world % (tp * pp * cp) == 0, f"tp {tp} x pp {pp} x cp {cp} = {tp * pp * cp} does not divide the world "
          f"size {world} ({world} % {tp * pp * cp} = {world % (tp * pp * cp)})", "parallel.cp", cp,
          f"choose cp with tp x pp x cp dividing {world}, or change the number of workers")
    _need(pp == 1, f"cp {cp} with pp {pp} is not supported by the trainer (ring attention inside pipeline "
          "stages)", "parallel.cp", cp, "use pp=1 with cp > 1")
    _need(p.strategy != "hsdp", f"cp {cp} with hsdp is not supported (cp shards with dp over one flat group)",
          "parallel.strategy", p.strategy, "use ddp, zero1, zero2 or zero3 with cp > 1")
    _need(not p.compile, f"cp {cp} with compile is not supported (the ring's send/recv inside a compiled block)",
          "parallel.compile", True, "set parallel.compile=false with cp > 1")
