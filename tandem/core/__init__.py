"""Shared ground of every stage: the job spec, typed errors, logging, artifact paths, and the
one-line check for a stage's extra (extras.py).

`core` imports no stage.
"""
