"""Layering of the whole package: every import between tandem's files, those inside functions too,
runs downward in the stage order below, and no files import each other round a circle.

A circle between files is two concepts cut from one (or one cut in two): each side needs the other.
An arrow up is an earlier stage needing a later one (a training run that cannot be built without the
server). Both are read statically: every ``import`` and ``from ... import`` of every
tandem/**/*.py, wherever it stands, plus ``importlib.import_module`` / ``runpy.run_module`` of a literal
``"tandem..."`` name (an import in all but name). There is no whitelist: a file that must reach up
moves, or what it needs moves down.

The stage order, low to high (a file may import its own stage and any lower one):

    tandem/__init__.py                     the package's name and version: imports nothing of tandem
                                           (every ``import tandem.x`` runs it first anyway)
    core                                   the contracts and helpers every stage meets in
    models, data                           what is trained on what: neither imports the other
    plan                                   the cost model and search (reads models' shapes)
    launch, submit                         agents on one node; backends that start them on clusters
    train                                  the worker: the step loop, checkpoints, parallelisms
    bench, diagnose, export                measure, explain, and package a trained run
    serve                                  inference from an export
    cli                                    the command line: a file per verb
    tandem/__main__.py                     ``python -m tandem``

Packages on one line are siblings: they never import each other, except where ``SIBLINGS`` says so
(submit starts launch's agents on each node; diagnose's doctor runs bench's collective workers).
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

import tandem

PKG = Path(tandem.__file__).parent

STAGES = (("__init__",), ("core",), ("models", "data"), ("plan",), ("launch", "submit"), ("train",),
          ("bench", "diagnose", "export"), ("serve",), ("cli",), ("__main__",))
RANK = {name: i for i, names in enumerate(STAGES) for name in names}
SIBLINGS = {("submit", "launch"), ("diagnose", "bench")}   # (importer, imported): the only arrows between siblings
DYNAMIC = {"import_module", "run_module"}


@dataclass(frozen=True)
class Arrow:
    src: str      # tandem/x/y.py
    dst: str      # tandem/z/w.py (the most specific file the name resolves to)
    line: int
    name: str     # the module as written


def _module_names(node: ast.AST, modname: str, is_pkg: bool) -> list[tuple[str, int]]:
    """Absolute module names an import node (or a dynamic import call) may load."""
    if isinstance(node, ast.Import):
        return [(a.name, node.lineno) for a in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # relative: resolve against the importing file's package
            parts = modname.split(".")
            parts = parts if is_pkg else parts[:-1]
            parts = parts[:len(parts) - node.level + 1]
            base = ".".join(parts + ([node.module] if node.module else []))
        # ``from a import b``: b may be a module (a/b.py) or a name defined in a/__init__.py
        return [(base, node.lineno)] + [(f"{base}.{a.name}", node.lineno) for a in node.names if a.name != "*"]
    if isinstance(node, ast.Call):
        f = node.func
        fname = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        if fname in DYNAMIC and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            return [(node.args[0].value, node.lineno)]
    return []


def _file_of(name: str, root: Path) -> str | None:
    """tandem/a/b.py or tandem/a/b/__init__.py for a module name; None when it is no file (a name in a module)."""
    if name != "tandem" and not name.startswith("tandem."):
        return None
    rel = Path(*name.split("."))
    for cand in (rel.with_suffix(".py"), rel / "__init__.py"):
        if (root / cand).is_file():
            return str(cand)
    return None


def arrows(pkg: Path = PKG) -> list[Arrow]:
    """Every import between two files of the package, as (importer, imported file)."""
    return list(_arrows(pkg))


@functools.lru_cache(maxsize=None)
def _arrows(pkg: Path) -> tuple[Arrow, ...]:
    root = pkg.parent
    out = []
    for p in sorted(pkg.rglob("*.py")):
        rel = p.relative_to(root)
        is_pkg = p.name == "__init__.py"
        modname = ".".join(rel.parent.parts if is_pkg else rel.with_suffix("").parts)
        tree = ast.parse(p.read_text(), filename=str(p))
        for node in ast.walk(tree):
            found: dict[str, Arrow] = {}
            names = _module_names(node, modname, is_pkg)
            for name, line in names:
                dst = _file_of(name, root)
                if dst is None or dst == str(rel):
                    continue
                found[dst] = Arrow(str(rel), dst, line, name)
            if isinstance(node, ast.ImportFrom) and names:
                # ``from a import b`` where b is a module: the arrow goes to a/b.py, not also to a/__init__.py
                base = _file_of(names[0][0], root)
                if base in found and len(found) > 1 and base.endswith("__init__.py"):
                    subs = [n for n, _ in names[1:] if _file_of(n, root) not in (None, base)]
                    if len(subs) == len(names) - 1:
                        found.pop(base)
            out.extend(found.values())
    return tuple(out)


def stage_of(path: str) -> str:
    """tandem/train/elastic/resume.py -> train; tandem/__init__.py -> __init__."""
    parts = Path(path).parts
    return parts[1] if len(parts) > 2 else Path(parts[1]).stem


def upward(pkg: Path = PKG) -> list[str]:
    """Arrows from a stage to a later one, or between siblings that SIBLINGS does not allow."""
    bad = []
    for a in arrows(pkg):
        s, d = stage_of(a.src), stage_of(a.dst)
        if s == d or (s, d) in SIBLINGS:
            continue
        if s not in RANK or d not in RANK:
            bad.append(f"{a.src}:{a.line} imports {a.name}: {s if s not in RANK else d} is in no stage (STAGES)")
        elif RANK[d] >= RANK[s]:
            how = "a sibling" if RANK[d] == RANK[s] else "a later stage"
            bad.append(f"{a.src}:{a.line} ({s}) imports {a.name} ({d}, {how})")
    return bad


def circles(pkg: Path = PKG) -> list[tuple[list[str], list[str]]]:
    """Each set of files tied in a circle (a strongly connected set, Tarjan's), with one cycle
    through it (a -> b -> ... -> a): the set names every file to untie, the cycle shows how."""
    graph: dict[str, set[str]] = {}
    for a in arrows(pkg):
        graph.setdefault(a.src, set()).add(a.dst)
        graph.setdefault(a.dst, set())
    index, low, stack, on, comps = {}, {}, [], set(), []

    def visit(v: str) -> None:  # recursion depth is bounded by the number of files (a few hundred)
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [(c, _cycle(c, graph)) for c in sorted(comps)]


def _cycle(comp: list[str], graph: dict[str, set[str]]) -> list[str]:
    """One cycle through the first file of a strongly connected set: a -> b -> ... -> a (breadth first)."""
    start, inside = comp[0], set(comp)
    prev: dict[str, str] = {}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v] & inside):
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(prev[path[-1]])
                return path[::-1] + [start]
            if w not in prev:
                prev[w] = v
                queue.append(w)
    return comp


def _report(items: list[str]) -> str:
    return "\n" + "\n".join(items)


def test_no_circle_between_files():
    found = circles()
    lines = [f"{len(files)} files in a circle: {', '.join(files)}\n    e.g. " + " -> ".join(cycle)
             for files, cycle in found]
    assert found == [], _report(lines)


def test_no_import_from_a_later_stage():
    bad = upward()
    assert bad == [], _report(bad)


def test_the_package_face_imports_nothing():
    """tandem/__init__.py stands below every stage: it may not import one."""
    assert [a for a in arrows() if a.src == "tandem/__init__.py"] == []


def test_every_stage_is_declared():
    """A new top-level package or module has a place in the order before it has imports."""
    tops = {p.stem if p.is_file() else p.name for p in PKG.iterdir()
            if (p.suffix == ".py" or (p / "__init__.py").is_file()) and p.name != "__pycache__"}
    assert tops - set(RANK) == set()


def _offending(folder: str, banned: tuple[str, ...], pkg: Path = PKG) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for a in arrows(pkg):
        if a.src.startswith(f"tandem/{folder}/") and a.name.startswith(banned):
            found.setdefault(a.src, []).append(a.name)
    return {k: sorted(set(v)) for k, v in found.items()}


def test_launch_never_imports_train():
    """The agents and the workers meet in tandem.core (the contract, the heartbeat page, the run dir)."""
    assert _offending("launch", ("tandem.train",)) == {}
    assert _offending("submit", ("tandem.train",)) == {}


def test_the_contract_imports_no_stage():
    """What both sides import must import neither."""
    stages = tuple(f"tandem.{s}" for s in RANK if RANK[s] > RANK["core"] and not s.startswith("__"))
    contract = {f"tandem/core/{m}.py" for m in ("contract", "rundir", "heartbeat", "runlock", "errors")}
    found = _offending("core", stages)
    assert {p: found[p] for p in contract if p in found} == {}


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    for d in {(tmp_path / rel).parent for rel in files}:
        while d != tmp_path:
            (d / "__init__.py").touch()
            d = d.parent
    return tmp_path / "tandem"


def test_the_check_sees_an_import_inside_a_function(tmp_path):
    pkg = _tree(tmp_path, {"tandem/launch/bad.py": "def f():\n    from tandem.train import metrics\n",
                           "tandem/train/metrics.py": ""})
    assert _offending("launch", ("tandem.train",), pkg) == {"tandem/launch/bad.py": ["tandem.train.metrics"]}
    assert upward(pkg) == ["tandem/launch/bad.py:2 (launch) imports tandem.train.metrics (train, a later stage)"]


def test_the_check_finds_an_upward_arrow_and_a_sibling(tmp_path):
    pkg = _tree(tmp_path, {"tandem/core/util.py": "import tandem.serve.auth\n",
                           "tandem/serve/auth.py": "from tandem.core import util\n",
                           "tandem/bench/x.py": "from tandem.export.y import z\n",
                           "tandem/export/y.py": "z = 1\n",
                           "tandem/submit/s.py": "from tandem.launch import n\n",   # allowed by SIBLINGS
                           "tandem/launch/n.py": "import runpy\nrunpy.run_module('tandem.train.w')\n",
                           "tandem/train/w.py": ""})
    assert upward(pkg) == ["tandem/bench/x.py:1 (bench) imports tandem.export.y (export, a sibling)",
                           "tandem/core/util.py:1 (core) imports tandem.serve.auth (serve, a later stage)",
                           "tandem/launch/n.py:2 (launch) imports tandem.train.w (train, a later stage)"]


def test_the_check_finds_a_circle(tmp_path):
    pkg = _tree(tmp_path, {"tandem/serve/a.py": "from tandem.serve import b\n",
                           "tandem/serve/b.py": "def f():\n    from . import c\n",
                           "tandem/serve/c.py": "import tandem.serve.a\n",
                           "tandem/serve/d.py": "from tandem.serve import a\n"})
    abc = ["tandem/serve/a.py", "tandem/serve/b.py", "tandem/serve/c.py"]
    assert circles(pkg) == [(abc, abc + ["tandem/serve/a.py"])]
