"""Layering: the agents (tandem.launch) never import the trainer (tandem.train); both meet in
tandem.core (the worker/agent contract, the heartbeat page, the run dir's names)."""

import ast
from pathlib import Path

import tandem

PKG = Path(tandem.__file__).parent


def _imports(folder: Path, root: Path) -> dict[str, set[str]]:
    out = {}
    for p in sorted(folder.rglob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
                names.update(f"{node.module}.{a.name}" for a in node.names)
        out[str(p.relative_to(root))] = names
    return out


def _offending(folder: str, banned: tuple[str, ...], pkg: Path = PKG) -> dict[str, list[str]]:
    found = {}
    for path, names in _imports(pkg / folder, pkg.parent).items():
        bad = sorted(n for n in names if n.startswith(banned))
        if bad:
            found[path] = bad
    return found


def test_launch_never_imports_train():
    assert _offending("launch", ("tandem.train",)) == {}


def test_the_contract_imports_no_stage():
    """What both sides import must import neither; nor does the rest of core (no verb lives there)."""
    stages = ("tandem.launch", "tandem.train", "tandem.plan", "tandem.bench", "tandem.serve", "tandem.export",
              "tandem.diagnose")
    contract = {f"tandem/core/{m}.py" for m in ("contract", "rundir", "heartbeat", "runlock", "errors")}
    found = _offending("core", stages)
    assert {p: found[p] for p in contract if p in found} == {}
    assert found == {}


def test_the_check_sees_an_import(tmp_path):
    """The checker itself: a module that imports tandem.train, even inside a function, is found."""
    (tmp_path / "tandem" / "launch").mkdir(parents=True)
    (tmp_path / "tandem" / "launch" / "bad.py").write_text("def f():\n    from tandem.train import metrics\n")
    assert _offending("launch", ("tandem.train",), tmp_path / "tandem") == {
        "tandem/launch/bad.py": ["tandem.train", "tandem.train.metrics"]}
