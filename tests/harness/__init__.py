"""Harnesses the tests (and bench/parallel_strategies.py) drive: not part of the tandem package.

numerics.py         run N steps of a job spec on real gloo processes (or one), weights, losses, bytes
planner_compare.py  the measured model states and communication beside `tandem plan`'s prediction
"""
