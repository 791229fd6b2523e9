"""How long the planner's strategy search takes: Narayanan et al. 2021's largest run, a 1T-parameter GPT on 3072
A100s (384 DGX nodes, 8 HDR NICs each), the case tests/plan/test_search.py keeps bounded.

    python bench/plan_search.py [--runs 7]

Per run: the whole search (wall and CPU seconds, time.perf_counter / time.process_time), and, in the same run,
one candidate's check + memory + evaluate (the winner's, median of 200): the baseline the search is read
against, since a busy host slows both. The ratio search / (baseline x candidates evaluated) is what the
search costs over evaluating each candidate once (below 1: most candidates are far out of memory and never
timed). Medians and ranges over the runs; the first search, which fills the caches, is run once apart.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandem.plan.inputs.training import Training  # noqa: E402
from tandem.plan.cost import check, evaluate  # noqa: E402
from tandem.plan.inputs.hardware import make_cluster  # noqa: E402
from tandem.plan.terms.memory import memory  # noqa: E402
from tandem.plan.inputs.model import preset  # noqa: E402
from tandem.plan.search import search  # noqa: E402


def one_candidate(m, c, t, s, n: int = 200) -> float:
    """Median seconds of one candidate's check + memory + evaluate (the cost model's unit of work)."""
    def once() -> float:
        t0 = time.perf_counter()
        check(m, c, t, s)
        evaluate(m, c, t, s, memory(m, c, t, s, t.global_batch // (s.dp * s.micro_batch)))
        return time.perf_counter() - t0
    return statistics.median(once() for _ in range(n))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    a = ap.parse_args()
    c = make_cluster("a100-80gb", 8, 384, inter="ib-hdr", nics_per_node=8)
    m, t = preset("gpt-1t"), Training(global_batch=3072, optimizer="adam")
    t0, p0 = time.perf_counter(), time.process_time()
    r = search(m, c, t)
    print(f"first search (cold caches): {time.perf_counter() - t0:.3f} s wall, {time.process_time() - p0:.3f} s CPU")
    rows = []
    for _ in range(a.runs):
        t0, p0 = time.perf_counter(), time.process_time()
        r = search(m, c, t)
        wall, cpu = time.perf_counter() - t0, time.process_time() - p0
        base = one_candidate(m, c, t, r.ranked[0].strategy)
        rows.append((wall, cpu, base, wall / (base * r.counts["evaluated"])))
    print(f"gpt-1t on {c.world} GPUs: {r.counts['evaluated']:,} candidates evaluated, {len(r.ranked):,} fit; "
          f"winner {r.ranked[0].strategy.label()}")
    for i, name in enumerate(("search wall s", "search CPU s", "one candidate ms", "ratio")):
        xs = [row[i] * (1e3 if i == 2 else 1) for row in rows]
        print(f"{name:<18} median {statistics.median(xs):8.4f}   range {min(xs):.4f} - {max(xs):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
