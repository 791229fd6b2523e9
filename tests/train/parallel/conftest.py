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


def _run(world: int) -> tuple[dict, list]:
    from harness.numerics import run_many, spawn
    cfgs, local = WORLDS[world]
    os.environ["TANDEM_COUNT_COMM"] = "1"   # count DDP's buckets too (inherited by the workers)
    try:
        ranks = spawn(run_many, world, cfgs, steps=STEPS, count=True, local_world=local)
    finally:
        os.environ.pop("TANDEM_COUNT_COMM", None)
    return cfgs, ranks


@pytest.fixture(scope="session")
def runs():
    """world -> (configs, [rank 0 results, rank 1 results, ...]), spawned on first use."""
    cache: dict = {}

    def get(world: int):
        if world not in cache:
            cache[world] = _run(world)
        return cache[world]
    return get
