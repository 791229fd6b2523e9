"""The launcher's command-line options, declared once for every verb that starts workers.

`tandem launch`, `tandem bench comm` and `tandem doctor` take the same torchrun-style
options. A verb names the ones it takes (their order is the --help order), may change a
default or a help line, and gets them as one ``launch: LaunchArgs`` argument:

    @launch_options("nproc_per_node", "nnodes", ..., nproc_per_node=(2, "Workers per node."))
    def comm_cmd(collectives: str = typer.Option(...), launch: LaunchArgs = None, run_dir: ...): ...

typer reads a command's options from its signature, so the decorator puts the named
options where the ``launch`` parameter stands and folds them back into a LaunchArgs.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import asdict, dataclass, fields
from typing import Callable, NamedTuple

import typer

from tandem.core.spec import LaunchSpec


@dataclass
class LaunchArgs:
    """The launcher options as given on the command line (LaunchSpec's fields, less run_dir)."""
    nproc_per_node: int = 1
    nnodes: str = "1"
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    rdzv_endpoint: str = ""
    simulate_nodes: int = 0
    max_restarts: int = 0
    timeout_s: int = 60
    device: str = "auto"
    backend: str = "auto"
    threads_per_worker: int = 0
    watchdog_s: float = 0
    last_call_s: int = 3

    def launch_spec(self) -> LaunchSpec:
        return LaunchSpec(**asdict(self))


class Opt(NamedTuple):
    field: str          # LaunchArgs field
    flag: str
    type: type
    default: object
    help: str


OPTIONS: dict[str, Opt] = {o.field if n is None else n: o for n, o in [
    (None, Opt("nproc_per_node", "--nproc-per-node", int, 1, "Workers per node.")),
    (None, Opt("nnodes", "--nnodes", str, "1", "Nodes, or MIN:MAX for elastic jobs.")),
    (None, Opt("node_rank", "--node-rank", int, 0, "This node's rank (static rendezvous).")),
    (None, Opt("master_addr", "--master-addr", str, "127.0.0.1", "Address of node 0.")),
    (None, Opt("master_port", "--master-port", int, 29500, "Rendezvous port on node 0.")),
    (None, Opt("rdzv_endpoint", "--rdzv-endpoint", str, "", "host:port of a c10d rendezvous.")),
    (None, Opt("simulate_nodes", "--simulate-nodes", int, 0, "K real agents on this machine.")),
    (None, Opt("max_restarts", "--max-restarts", int, 0, "Restarts of the worker group on failure.")),
    ("timeout", Opt("timeout_s", "--timeout", int, 60, "Seconds to wait for the rendezvous.")),
    (None, Opt("watchdog_s", "--watchdog-s", float, 0, "Hang watchdog: end the group when a rank that writes "
                                                        "heartbeats stalls this long (0: off).")),
    (None, Opt("last_call_s", "--last-call-s", int, 3, "Elastic MIN:MAX: wait this long for more nodes once "
                                                        "MIN joined.")),
    (None, Opt("device", "--device", str, "auto", "auto | cpu | cuda.")),
    (None, Opt("backend", "--backend", str, "auto", "auto | gloo | nccl.")),
    ("threads", Opt("threads_per_worker", "--threads-per-worker", int, 0, "Intra-op threads (0: cores / workers).")),
]}

assert {o.field for o in OPTIONS.values()} == {f.name for f in fields(LaunchArgs)}


def launch_options(*names: str, **overrides: tuple[object, str]) -> Callable:
    """Give a typer command the launcher options `names` (in that order) where its ``launch`` parameter is.

    ``overrides``: option name -> (default, help) for a verb whose default or wording differs.
    """
    unknown = [n for n in (*names, *overrides) if n not in OPTIONS]
    if unknown:
        raise ValueError(f"unknown launcher option(s) {unknown}; known: {', '.join(OPTIONS)}")

    def deco(fn: Callable) -> Callable:
        sig = inspect.signature(fn)
        params = list(sig.parameters.values())
        at = [p.name for p in params].index("launch")
        added = []
        for n in names:
            o = OPTIONS[n]
            default, help_ = overrides.get(n, (o.default, o.help))
            added.append(inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=o.type,
                                           default=typer.Option(default, o.flag, help=help_)))

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            given = {OPTIONS[n].field: kwargs.pop(n) for n in names if n in kwargs}
            return fn(*args, launch=LaunchArgs(**given), **kwargs)

        wrapper.__signature__ = sig.replace(parameters=params[:at] + added + params[at + 1:])
        hints = {k: v for k, v in getattr(fn, "__annotations__", {}).items() if k != "launch"}
        hints.update({n: OPTIONS[n].type for n in names})
        wrapper.__annotations__ = hints  # get_type_hints evaluates them in fn's globals (via __wrapped__)
        return wrapper

    return deco
