"""Mixture-of-experts and expert-parallel rules, checked before any process starts (no torch here).

    check_moe(m)                              # the model's MoE keys (model.experts, top_k, ...)
    check_ep(spec, world, tp, pp, cp, dp)     # parallel.ep against the model and the other degrees

Each failure is one ConfigError line: field, value, fix. ``m`` is a ``ModelSpec`` or anything with
its field names (``tandem/models/llama.py``'s config checks itself with the same function).
"""

from __future__ import annotations

import math

from tandem.core.errors import ConfigError


def _need(cond: bool, message: str, field: str, value, fix: str) -> None:
    if not cond:
        raise ConfigError(message, field=field, value=value, fix=fix)


def moe_enabled(m) -> bool:
    return getattr(m, "experts", 0) > 0


def capacity(tokens: int, top_k: int, experts: int, factor: float) -> int:
    """Slots per expert for ``tokens`` tokens of a micro-batch: ceil(factor x tokens x top_k / experts)
    (GShard's and Switch's capacity, the planner's ``capacity_factor``)."""
    return max(1, math.ceil(factor * tokens * top_k / experts))


def check_moe(m) -> None:
    """Raise a ConfigError for MoE keys that cannot build (nothing to check when experts is 0)."""
    _need(m.experts >= 0, f"must be 0 (dense) or more, got {m.experts}", "model.experts", m.experts,
          "give 0 for a dense MLP or the number of routed experts")
    if not m.experts:
        return
    _need(m.name == "llama", f"experts replace the Llama decoder's SwiGLU MLP; model {m.name!r} has none",
          "model.experts", m.experts, "use model.name=llama, or model.experts=0")
    _need(1 <= m.top_k <= m.experts, f"top_k {m.top_k} must be between 1 and experts {m.experts}: each token "
          f"picks top_k distinct experts", "model.top_k", m.top_k,
          f"choose top_k in 1..{m.experts}, or more experts")
    for k in ("shared_experts", "expert_ffn"):
        _need(getattr(m, k) >= 0, f"must be 0 or more, got {getattr(m, k)}", f"model.{k}", getattr(m, k),
              "give 0 or a positive number")
    _need(m.capacity_factor > 0, f"capacity_factor must be positive, got {m.capacity_factor}",
          "model.capacity_factor", m.capacity_factor, "use e.g. 1.25 (1.0: exactly the balanced share)")
    for k in ("router_aux_loss", "router_z_loss"):
        v = getattr(m, k)
        _need(v >= 0, f"a loss coefficient must be 0 (off) or positive, got {v}", f"model.{k}", v,
              "use e.g. 0.01 (aux) or 0.001 (z), or 0 to turn it off")


def check_ep(spec, world: int, tp: int, pp: int, cp: int, dp: int) -> None:
    """parallel.ep and the MoE model against the other degrees (the trainer's support: ep under ddp, zero2 and
    zero3, with or without tp; the router and each rank's experts whole on its tp ranks; a mixture of experts
    under pp with ep 1)."""
    p, m = spec.parallel, spec.model
    ep = p.ep
    _need(isinstance(ep, int) and ep >= 1, f"ep must be at least 1, got {ep}", "parallel.ep", ep, "give ep >= 1")
    if moe_enabled(m):   # what the trainer cannot split yet, before the ep arithmetic
        _need(cp == 1, f"model.experts {m.experts} with cp {cp} is not supported by the trainer (routing capacity "
              f"would be counted per sequence chunk, not per micro-batch)", "parallel.cp", cp,
              "use cp=1 with a mixture of experts (dp and ep split it)")
        _need(not p.compile, "model.experts with compile is not supported (data-dependent routing in each block)",
              "parallel.compile", True, "set parallel.compile=false with model.experts > 0")
    if ep > 1:
        _need(pp == 1, f"ep {ep} with pp {pp} is not supported by the trainer (its expert mesh has no pipeline "
              f"dimension; a mixture of experts trains under pp with ep 1)", "parallel.pp", pp,
              "use pp=1 with ep > 1, or ep=1 with pp")
        _need(moe_enabled(m), f"ep {ep} splits a mixture of experts; model.experts is {m.experts}",
              "parallel.ep", ep, "set model.experts (and model.name=llama), or ep=1")
        _need(m.experts % ep == 0, f"ep {ep} does not divide experts {m.experts} ({m.experts} % {ep} = "
              f"{m.experts % ep}): each ep rank holds experts / ep of them", "parallel.ep", ep,
              f"choose ep among the divisors of {m.experts}, or a multiple of {ep} experts")
        _need(dp % ep == 0, f"ep {ep} does not divide dp {dp} = world {world} / (tp {tp} x pp {pp} x cp {cp}) "
              f"({dp} % {ep} = {dp % ep}): the ep groups are carved out of the data-parallel ranks",
              "parallel.ep", ep, f"choose ep among the divisors of {dp}, or change the number of workers")
        _need(p.strategy in ("ddp", "zero2", "zero3", "fsdp"), f"ep {ep} with strategy {p.strategy!r} is not "
              "supported (zero1 broadcasts every parameter from its owner, hsdp's 2D mesh has no expert "
              "dimension)", "parallel.strategy", p.strategy, "use ddp, zero2 or zero3 with ep > 1")
        _need(p.comm_hook == "none" and not p.local_sgd_every, f"ep {ep} with a comm hook or local SGD is not "
              "supported (the expert gradients reduce outside DDP)", "parallel.comm_hook", p.comm_hook,
              "turn comm_hook and local_sgd_every off with ep > 1")
