"""Shared ground of every stage: the job spec, typed errors, logging, artifact paths.

`core` imports no stage.
"""
