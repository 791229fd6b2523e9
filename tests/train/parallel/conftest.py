"""Shared runs for the multi-process parallel tests: each world size is spawned once per session and
runs every configuration of that size in turn (process start-up dominates on 2 cores)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest


def _load_jobs():
    if "parallel_jobs" not in sys.modules:
        spec = importlib.util.spec_from_file_location("parallel_jobs", Path(__file__).with_name("parallel_jobs.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules["parallel_jobs"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["parallel_jobs"]


jobs = _load_jobs()
STEPS, WORLDS = jobs.STEPS, jobs.WORLDS


class _Results(dict):
    """One rank's results by configuration name; a configuration this session did not run says why."""

    def __missing__(self, name):
        raise KeyError(f"{name!r} was not run: the quick subset (no slow test selected) runs only "
                       f"parallel_jobs.QUICK's configurations; add it there or mark the test slow")


def _run(world: int, full: bool) -> tuple[dict, list]:
    from harness.numerics import run_many, spawn
    cfgs, local = WORLDS[world]
    quick = jobs.QUICK.get(world)
    chosen = cfgs if full or quick is None else {n: c for n, c in cfgs.items() if n in quick}
    os.environ["TANDEM_COUNT_COMM"] = "1"   # count DDP's buckets too (inherited by the workers)
    try:
        ranks = spawn(run_many, world, chosen, steps=STEPS, count=True, local_world=local)
    finally:
        os.environ.pop("TANDEM_COUNT_COMM", None)
    return cfgs, [_Results(r) for r in ranks]


@pytest.fixture(scope="session")
def runs(request):
    """world -> (configs, [rank 0 results, rank 1 results, ...]), spawned on first use: every
    configuration of that size in one spawn, or, in a session that selected no slow test using this
    fixture (the quick subset, -m "not slow"), only those in parallel_jobs.QUICK (the rest are
    slow-marked cases: the full suite still runs them all in the same single spawn)."""
    full = any(item.get_closest_marker("slow") for item in request.session.items
               if "runs" in getattr(item, "fixturenames", ()))
    cache: dict = {}

    def get(world: int):
        if world not in cache:
            cache[world] = _run(world, full)
        return cache[world]
    return get
