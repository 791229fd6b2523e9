"""The serving package's structure: both engines implement every member of the declared Engine interface
themselves (none falls back to the protocol's empty body), the pool implements the Feed its continuous
batcher reads, and no two modules of tandem/serve import each other, directly or around a loop."""

from __future__ import annotations

import ast
import asyncio
import inspect
from pathlib import Path

from tandem.serve.engine import Engine, Feed
from tandem.serve.metrics import Metrics
from tandem.serve.pool import Pool, PoolOptions
from tandem.serve.ray_engine import RayPool

SERVE = Path(__file__).resolve().parents[2] / "tandem" / "serve"


def _members(proto) -> set[str]:
    return {n for n in proto.__dict__ if not n.startswith("_")} | set(proto.__annotations__)


def _defines(cls, obj, name: str) -> bool:
    """``name`` set on the instance, or defined by the class or a base that is not one of the protocols."""
    if name in vars(obj):
        return True
    owner = next((k for k in cls.__mro__ if name in vars(k)), None)
    return owner is not None and owner not in (Engine, Feed)


def _imports() -> dict[str, set[str]]:
    """Module -> the tandem.serve modules it imports, lazy imports inside functions included; those under
    ``if TYPE_CHECKING:`` are for type checkers only and never run."""
    def walk(node):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            return
        yield node
        for child in ast.iter_child_nodes(node):
            yield from walk(child)
    graph = {}
    for f in SERVE.glob("*.py"):
        deps = {n.module.split(".")[2] for n in walk(ast.parse(f.read_text()))
                if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("tandem.serve.")}
        graph[f.stem] = deps - {f.stem}
    return graph


def test_engines_implement_the_interface_and_serve_has_no_import_cycle(tmp_path):
    opts = PoolOptions(export=tmp_path, run_dir=tmp_path)
    pool = asyncio.run(_make(Pool, opts))
    ray = RayPool(opts, Metrics())
    for cls, obj, protos in ((Pool, pool, (Engine, Feed)), (RayPool, ray, (Engine,))):
        assert all(p in cls.__mro__ for p in protos)   # declared, not only shaped alike
        for p in protos:
            missing = [n for n in _members(p) if not _defines(cls, obj, n)]
            assert not missing, f"{cls.__name__} lacks {missing} of {p.__name__}"
        for n in _members(Engine):   # the calls take what the interface says
            proto_fn = getattr(Engine, n, None)
            if inspect.isfunction(proto_fn):
                assert list(inspect.signature(getattr(cls, n)).parameters) == \
                    list(inspect.signature(proto_fn).parameters), (cls.__name__, n)
    graph = _imports()
    assert "pool" not in graph["stream"] and "stream" in graph["pool"]

    def reach(a: str, seen: set) -> set:
        for b in graph.get(a, ()):
            if b not in seen:
                seen.add(b)
                reach(b, seen)
        return seen
    loops = sorted(m for m in graph if m in reach(m, set()))
    assert not loops, f"modules of tandem/serve on an import loop: {loops}"


async def _make(cls, opts):   # the pool's Condition and Events belong to a running loop
    return cls(opts, Metrics())
