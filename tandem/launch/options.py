"""The launcher's command-line options, declared once for every verb that starts workers.

`tandem launch`, `tandem bench comm` and `tandem doctor` take the same torchrun-style
options: the fields of ``tandem.core.spec.LaunchSpec`` (their one definition: type, default,
help), under torchrun's flag names. A verb names the ones it takes (their order is the --help
order), may change a default or a help line, and gets them as one ``launch: LaunchSpec``:

    @launch_options("nproc_per_node", "nnodes", ..., nproc_per_node=(2, "Workers per node."))
    def comm_cmd(collectives: str = typer.Option(...), launch: LaunchSpec = None, run_dir: ...): ...

typer reads a command's options from its signature, so the decorator puts the named
options where the ``launch`` parameter stands and folds them back into a LaunchSpec.
``check(launch)`` validates it by ``tandem.core.validate.validate_launch``, the rules a job
spec's [launch] section obeys too, naming the flags in its errors.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from typing import Callable

import typer

from tandem.core.spec import LaunchSpec
from tandem.core.validate import validate_launch

# option name (a Python parameter of the verb) -> (LaunchSpec field, flag). run_dir is no option
# here: each verb has its own --run-dir.
OPTIONS: dict[str, tuple[str, str]] = {
    "nproc_per_node": ("nproc_per_node", "--nproc-per-node"), "nnodes": ("nnodes", "--nnodes"),
    "node_rank": ("node_rank", "--node-rank"), "master_addr": ("master_addr", "--master-addr"),
    "master_port": ("master_port", "--master-port"), "rdzv_endpoint": ("rdzv_endpoint", "--rdzv-endpoint"),
    "simulate_nodes": ("simulate_nodes", "--simulate-nodes"), "max_restarts": ("max_restarts", "--max-restarts"),
    "timeout": ("timeout_s", "--timeout"), "watchdog_s": ("watchdog_s", "--watchdog-s"),
    "last_call_s": ("last_call_s", "--last-call-s"), "device": ("device", "--device"),
    "backend": ("backend", "--backend"), "threads": ("threads_per_worker", "--threads-per-worker"),
}
FIELDS = {n: f for n, (f, _) in OPTIONS.items()}
_SPEC_FIELDS = {f.name: f for f in dataclasses.fields(LaunchSpec)}
_TYPES = typing.get_type_hints(LaunchSpec)
assert set(FIELDS.values()) == set(_SPEC_FIELDS) - {"run_dir"}, "a LaunchSpec field has no flag"


def flag(field: str) -> str:
    """``timeout_s`` -> ``--timeout``: the flag that sets a LaunchSpec field."""
    return next(fl for f, fl in OPTIONS.values() if f == field)


def check(launch: LaunchSpec) -> LaunchSpec:
    """validate_launch with the flags' names in its errors."""
    return validate_launch(launch, flag)


def launch_options(*names: str, **overrides: tuple[object, str]) -> Callable:
    """Give a typer command the launcher options `names` (in that order) where its ``launch`` parameter is.

    ``overrides``: option name -> (default, help) for a verb whose default or wording differs.
    """
    unknown = [n for n in (*names, *overrides) if n not in FIELDS]
    if unknown:
        raise ValueError(f"unknown launcher option(s) {unknown}; known: {', '.join(FIELDS)}")

    def deco(fn: Callable) -> Callable:
        sig = inspect.signature(fn)
        params = list(sig.parameters.values())
        at = [p.name for p in params].index("launch")
        added = []
        for n in names:
            f = _SPEC_FIELDS[FIELDS[n]]
            default, help_ = overrides.get(n, (f.default, f.metadata["help"]))
            added.append(inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=_TYPES[f.name],
                                           default=typer.Option(default, OPTIONS[n][1], help=help_)))

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            given = {FIELDS[n]: kwargs.pop(n) for n in names if n in kwargs}
            return fn(*args, launch=LaunchSpec(**given), **kwargs)

        wrapper.__signature__ = sig.replace(parameters=params[:at] + added + params[at + 1:])
        hints = {k: v for k, v in getattr(fn, "__annotations__", {}).items() if k != "launch"}
        hints.update({n: _TYPES[FIELDS[n]] for n in names})
        wrapper.__annotations__ = hints  # get_type_hints evaluates them in fn's globals (via __wrapped__)
        return wrapper

    return deco
