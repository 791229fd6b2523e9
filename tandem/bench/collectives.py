"""The collectives `tandem bench comm` measures, with nccl-tests semantics.

Each collective knows three things: how to lay out its buffers for a message
of ``size`` bytes, how to run once (in place or out of place), and what every
rank must hold afterwards. ``size`` is the number nccl-tests prints in its
"size" column: the full buffer (all_gather: the gathered output,
reduce_scatter: the input before scattering), so algbw = size / time and
busbw = algbw * bus_factor(n) match nccl-tests row for row.

Inputs are small integers (``_pattern``) so sums are exact in fp32 and in
bf16/fp16 for moderate world sizes; the check compares against an expected
tensor computed independently in float64.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
    "fp64": torch.float64, "int32": torch.int32,
}


def bus_factor(name: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor: busbw = algbw * factor (PERFORMANCE.md)."""
    if n <= 1:
        return 1.0 if name in ("broadcast", "reduce", "sendrecv") else 0.0
    if name == "all_reduce":
        return 2.0 * (n - 1) / n
    if name in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0  # broadcast, reduce, sendrecv


# torch 2.13 renamed the tensor variants (*_single); older releases only have the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

BLOCK = 1 << 20  # elements per step when filling or checking: bounds the float64 temporaries


def _pattern(idx: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank- and index-dependent values in 0..6: a swapped, stale or missing chunk shows."""
    return torch.remainder(idx + rank * 3, 7)


def _fill(numel: int, dtype: torch.dtype, device: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    t = torch.empty(numel, dtype=dtype, device=device)
    for o in range(0, numel, BLOCK):
        idx = torch.arange(o, min(numel, o + BLOCK), dtype=torch.float64)
        t[o:o + idx.numel()].copy_(fn(idx))
    return t


Expected = Callable[[torch.Tensor], torch.Tensor]  # float64 output indices -> float64 values


@dataclass
class Buffers:
    inp: torch.Tensor
    out: torch.Tensor        # same object as inp when in place
    expected: Expected       # what out[idx] must hold after one call on fresh buffers
    check_root_only: bool = False  # reduce: only the root's output is defined


@dataclass(frozen=True)
class Collective:
    name: str
    in_place: bool          # whether an in-place variant exists
    divisible: bool         # size must split into n equal chunks
    buffers: Callable[..., Buffers]
    run: Callable[[Buffers, object, int], None]  # (buffers, ProcessGroup, rank in group)


def _sum_over_ranks(idx: torch.Tensor, n: int) -> torch.Tensor:
    return sum(_pattern(idx, r) for r in range(n))


# Each builder: (numel, rank, n, dtype, device, in_place) -> Buffers; numel is the
# nccl-tests element count of `size`, already divisible by n where chunks are needed.

def _ar_buffers(numel, rank, n, dtype, device, in_place):
    inp = _fill(numel, dtype, device, lambda i: _pattern(i, rank))
    out = inp if in_place else torch.empty_like(inp)
    return Buffers(inp, out, lambda i: _sum_over_ranks(i, n))


def _ar_run(b: Buffers, group, grank: int) -> None:
    if b.out is not b.inp:
        # torch has no out-of-place all_reduce; the copy is what an out-of-place
        # caller pays, and it moves the bytes nccl-tests' out-of-place moves.
        b.out.copy_(b.inp)
    dist.all_reduce(b.out, op=dist.ReduceOp.SUM, group=group)


def _ag_buffers(numel, rank, n, dtype, device, in_place):
    c = numel // n
    mine = _fill(c, dtype, device, lambda i: _pattern(i, rank))
    if in_place:
        out = torch.empty(numel, dtype=dtype, device=device)
        inp = out.narrow(0, rank * c, c)
        inp.copy_(mine)
    else:
        inp, out = mine, torch.empty(numel, dtype=dtype, device=device)
    # Output chunk j is rank j's pattern over local indices 0..c-1.
    return Buffers(inp, out, lambda i: torch.remainder(
        torch.remainder(i, c) + 3 * torch.div(i, c, rounding_mode="floor"), 7))


def _ag_run(b: Buffers, group, grank: int) -> None:
    _all_gather(b.out, b.inp, group=group)


def _rs_buffers(numel, rank, n, dtype, device, in_place):
    c = numel // n
    inp = _fill(numel, dtype, device, lambda i: _pattern(i, rank))
    out = inp.narrow(0, rank * c, c) if in_place else torch.empty(c, dtype=dtype, device=device)
    return Buffers(inp, out, lambda i: _sum_over_ranks(i + rank * c, n))


def _rs_run(b: Buffers, group, grank: int) -> None:
    _reduce_scatter(b.out, b.inp, op=dist.ReduceOp.SUM, group=group)


def _a2a_buffers(numel, rank, n, dtype, device, in_place):
    c = numel // n
    inp = _fill(numel, dtype, device, lambda i: _pattern(i, rank))
    # Output chunk j comes from rank j: its input chunk number `rank`.
    return Buffers(inp, torch.empty_like(inp), lambda i: torch.remainder(
        rank * c + torch.remainder(i, c) + 3 * torch.div(i, c, rounding_mode="floor"), 7))


def _a2a_run(b: Buffers, group, grank: int) -> None:
    dist.all_to_all_single(b.out, b.inp, group=group)


def _bc_buffers(numel, rank, n, dtype, device, in_place):
    # Non-roots start from their own pattern so a broadcast that did nothing fails the check.
    inp = _fill(numel, dtype, device, lambda i: _pattern(i, rank))
    return Buffers(inp, inp, lambda i: _pattern(i, 0))


def _bc_run(b: Buffers, group, grank: int) -> None:
    dist.broadcast(b.out, group_src=0, group=group)


def _red_buffers(numel, rank, n, dtype, device, in_place):
    inp = _fill(numel, dtype, device, lambda i: _pattern(i, rank))
    out = inp if in_place else torch.empty_like(inp)
    return Buffers(inp, out, lambda i: _sum_over_ranks(i, n), check_root_only=True)


def _red_run(b: Buffers, group, grank: int) -> None:
    if b.out is not b.inp:
        b.out.copy_(b.inp)
    dist.reduce(b.out, group_dst=0, op=dist.ReduceOp.SUM, group=group)


def _sr_buffers(numel, rank, n, dtype, device, in_place):
    inp = _fill(numel, dtype, device, lambda i: _pattern(i, rank))
    return Buffers(inp, torch.empty_like(inp), lambda i: _pattern(i, (rank - 1) % n))


def _sr_run(b: Buffers, group, grank: int) -> None:
    # Ring exchange with both neighbours in flight at once, as nccl-tests' sendrecv.
    ranks = dist.get_process_group_ranks(group)
    n = len(ranks)
    nxt, prv = ranks[(grank + 1) % n], ranks[(grank - 1) % n]
    ops = [dist.P2POp(dist.isend, b.inp, nxt, group=group), dist.P2POp(dist.irecv, b.out, prv, group=group)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()


COLLECTIVES: dict[str, Collective] = {c.name: c for c in [
    Collective("all_reduce", True, False, _ar_buffers, _ar_run),
    Collective("all_gather", True, True, _ag_buffers, _ag_run),
    Collective("reduce_scatter", True, True, _rs_buffers, _rs_run),
    Collective("all_to_all", False, True, _a2a_buffers, _a2a_run),
    Collective("broadcast", True, False, _bc_buffers, _bc_run),
    Collective("reduce", True, False, _red_buffers, _red_run),
    Collective("sendrecv", False, False, _sr_buffers, _sr_run),
]}


def numel_for(coll: Collective, size: int, elem: int, n: int) -> int:
    """Element count for a requested size, rounded down so chunks split evenly (as nccl-tests does)."""
    numel = size // elem
    if coll.divisible:
        numel -= numel % n
    return numel


def check(b: Buffers, grank: int) -> float:
    """Max absolute error of the output against the expected values (0.0 when exact)."""
    if b.check_root_only and grank != 0:
        return 0.0
    err = 0.0
    numel = b.out.numel()
    for o in range(0, numel, BLOCK):
        got = b.out[o:o + BLOCK].detach().to("cpu", torch.float64)
        idx = torch.arange(o, o + got.numel(), dtype=torch.float64)
        err = max(err, float((got - b.expected(idx)).abs().max()))
    return err


def tolerance(dtype: torch.dtype, n: int) -> float:
    """Inputs are integers in 0..6: fp32/fp64/int32 must match exactly (sums stay far below
    2^24); 16-bit sums of up to 6n may round at each of the n-1 reduction steps."""
    if dtype in (torch.float32, torch.float64, torch.int32):
        return 0.0
    return max(0.5, 6 * n * torch.finfo(dtype).eps)


def _names_agree() -> None:
    from tandem.bench import options

    assert tuple(COLLECTIVES) == options.COLLECTIVES and tuple(DTYPES) == options.DTYPES


_names_agree()
