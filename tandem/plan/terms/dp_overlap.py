"""How much of each data-parallel collective the compute hides, as the frameworks schedule them.

- Gradient buckets (DDP, ZeRO-1/2 reduce-scatter, Megatron's distributed optimizer): backward
  produces the buckets one after another and each is reduced as soon as it is full, on one
  communication stream. With k equal buckets of c = t/k seconds ready evenly through a window w,
  bucket i starts at max(i x w/k, end of bucket i-1), so the last one ends at
  max(w + c, w/k + t): exposed = max(c, t - w x (k-1)/k). The last bucket is always exposed
  (it is ready only when backward ends); the rest hide while the window lasts
  (Li et al., *PyTorch Distributed*, VLDB 2020, §3.2.3 and Figure 7).
- The same formula with the window in front (prefetch): Megatron's ``--overlap-param-gather``
  gathers the updated parameters bucket by bucket during the next step's forward.
- FSDP (one unit per transformer block): forward all-gathers block i+1 while block i computes,
  backward all-gathers block i-1 and reduce-scatters block i while block i computes
  (Zhao et al., *PyTorch FSDP*, VLDB 2023, §3.3 and Figure 5). The first gather in each pass and
  the last reduce-scatter are exposed; each other block exposes what its communication takes
  beyond its compute.
"""

from __future__ import annotations

from dataclasses import dataclass


def pipelined(total_s: float, chunks: int, window_s: float) -> float:
    """Exposed seconds of ``chunks`` equal collectives fed (or consumed) evenly by a compute window."""
    if total_s <= 0:
        return 0.0
    k = max(1, chunks)
    return max(total_s / k, total_s - window_s * (k - 1) / k)


def manual(total_s: float, fraction: float, window_s: float) -> float:
    """``--overlap F``: F of the window hides communication, whatever the framework does."""
    return max(0.0, total_s - fraction * window_s)


@dataclass(frozen=True)
class FSDPExposed:
    gather_s: float      # exposed all-gather seconds per micro-batch
    scatter_s: float     # exposed reduce-scatter seconds per micro-batch


def fsdp(units: int, gather_s: float, scatter_s: float, fwd_s: float, bwd_s: float,
         root_gather_s: float = 0.0, root_scatter_s: float = 0.0) -> FSDPExposed:
    """One micro-batch of FSDP with ``units`` equal blocks: ``gather_s``/``scatter_s`` one block's
    all-gather/reduce-scatter, ``fwd_s``/``bwd_s`` one block's compute. The root unit (embeddings,
    head: FSDP2 keeps it gathered through the micro-batch) is gathered first and reduced last,
    both exposed."""
    n = max(1, units)
    a, r = gather_s, scatter_s
    fwd = a + (n - 1) * max(0.0, a - fwd_s)
    bwd_gather = a + (n - 1) * max(0.0, a - bwd_s)
    # backward blocks share the window between the next gather and this reduce-scatter; what overflows
    # beyond the gather's own overflow is charged to the reduce-scatter
    bwd_scatter = r + (n - 1) * (max(0.0, a + r - bwd_s) - max(0.0, a - bwd_s))
    return FSDPExposed(fwd + bwd_gather + root_gather_s, bwd_scatter + root_scatter_s)
