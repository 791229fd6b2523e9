"""The cost of the trainer's phase markers outside the profiling window, against the same step without them.

    python bench/profile_overhead.py [--steps 10] [--repeats 5] [--width 4]

One process, the tiny digits ResNet on CPU (the trainer's steps, smallest case: the markers weigh
most there). Side A runs forward/backward/optimizer bare; side B wraps them as the trainer does,
``with prof.phase(...)`` around data, forward, backward, optimizer and sync, with a StepProfiler
whose window is elsewhere (``enabled`` and ``start_step`` far ahead). Sides interleave A/B, B/A, ...
so machine noise hits both; the headline is the median paired ratio B/A of the mean step time,
with the markers' own cost (a micro-benchmark of ``phase()``, 8 per step) as a share of the step.
Target: under 1%.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from types import SimpleNamespace


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--width", type=int, default=4)
    a = ap.parse_args()

    import torch
    import torch.nn.functional as F

    from tandem.core.spec import ProfileSpec
    from tandem.models.resnet import ResNet
    from tandem.train.profile import StepProfiler

    torch.manual_seed(0)
    torch.set_num_threads(1)  # as a worker on this machine gets (cores / workers)
    model = ResNet(depth=18, width=a.width, num_classes=10, in_channels=1, small_input=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 1, 8, 8), torch.randint(0, 10, (16,))
    ctx = SimpleNamespace(rank=0, world=1, device=torch.device("cpu"), backend="gloo")
    prof = StepProfiler(ProfileSpec(enabled=True, start_step=10**9, steps=1), ctx, Path("/nonexistent"))

    def bare(n):
        for _ in range(n):
            xb, yb = x.clone(), y
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            float(loss.detach())

    def marked(n):
        for i in range(n):
            prof.step(i)
            with prof.phase("data"):
                xb, yb = x.clone(), y
            with prof.phase("forward"):
                loss = F.cross_entropy(model(xb), yb)
            with prof.phase("backward"):
                loss.backward()
            with prof.phase("sync"):
                pass
            with prof.phase("optimizer"):
                opt.step()
                opt.zero_grad(set_to_none=True)
            with prof.phase("sync"):
                float(loss.detach())

    def timed(fn) -> float:
        t = time.perf_counter()
        fn(a.steps)
        return (time.perf_counter() - t) / a.steps

    bare(5), marked(5)  # warm-up
    ratios, steps = [], []
    for k in range(a.repeats):
        order = (bare, marked) if k % 2 == 0 else (marked, bare)
        t = {fn.__name__: timed(fn) for fn in order}
        ratios.append(t["marked"] / t["bare"])
        steps.append(t["bare"])
    n = 200_000
    t0 = time.perf_counter()
    for _ in range(n):
        with prof.phase("forward"):
            pass
    per_call = (time.perf_counter() - t0) / n
    step = statistics.median(steps)
    print(f"step (bare, median): {step * 1e3:.2f} ms; phase() outside the window: {per_call * 1e9:.0f} ns a call")
    print(f"markers' own cost: 8 a step = {100 * 8 * per_call / step:.4f}% of the step (target < 1%)")
    print(f"paired ratio marked/bare, median of {a.repeats}: {statistics.median(ratios):.4f} "
          f"(spread {min(ratios):.3f}-{max(ratios):.3f}: machine noise)")


if __name__ == "__main__":
    main()
