"""Helpers shared by the published-table tests (tests/plan/test_published_*.py)."""


def fit(ms, ts):
    """Least squares t = a x m + b over a table's rows (m micro-batches a step, t seconds a step): (a, b), the time a
    micro-batch and the fixed time a step."""
    n = len(ms)
    mm, mt = sum(ms) / n, sum(ts) / n
    a = sum((m - mm) * (t - mt) for m, t in zip(ms, ts)) / sum((m - mm) ** 2 for m in ms)
    return a, mt - a * mm
