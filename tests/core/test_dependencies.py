"""Every module the package imports is declared in pyproject.toml (the click that typer stopped
installing crashed every usage error), checked two ways: statically over every import
statement (fast), and by importing every module in a fresh venv made from pyproject alone (slow)."""

import ast
import importlib.metadata as md
import re
import subprocess
import sys
import tomllib

import pytest

from tandem_testing import ROOT

PKG = ROOT / "tandem"


def _declared() -> tuple[set[str], set[str]]:
    """(required distributions, distributions of the extras), normalised names."""
    proj = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    name = lambda req: re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0].lower().replace("_", "-")  # noqa: E731
    extras = {name(r) for reqs in proj.get("optional-dependencies", {}).values() for r in reqs}
    return {name(r) for r in proj["dependencies"]}, extras


def _imports(path) -> list[tuple[str, bool]]:
    """(top-level module, at module level?) for every import in a file. Imports inside a function
    or a try block may be optional features; at module level they are required."""
    tree = ast.parse(path.read_text())
    found = []

    def visit(node, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Try))
            if isinstance(child, ast.Import):
                found.extend((a.name.split(".")[0], top) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                found.append((child.module.split(".")[0], top))
            visit(child, nested)

    visit(tree, True)
    return found


def test_every_imported_distribution_is_declared():
    required, extras = _declared()
    dists = {k: {d.lower().replace("_", "-") for d in v} for k, v in md.packages_distributions().items()}
    problems = []
    for f in sorted(PKG.rglob("*.py")):
        for mod, top in _imports(f):
            if mod in sys.stdlib_module_names or mod in ("tandem", "__future__"):
                continue
            owners = dists.get(mod)
            where = f"{f.relative_to(ROOT)} imports {mod}"
            if not owners:
                problems.append(f"{where}: installed by no distribution here (undeclared, or from another package)")
            elif top and not owners & required:
                problems.append(f"{where} at module level: {sorted(owners)} is not in [project].dependencies")
            elif not owners & (required | extras):
                problems.append(f"{where}: {sorted(owners)} is declared nowhere in pyproject.toml")
    assert not problems, "\n".join(problems)


@pytest.mark.slow
def test_every_module_imports_in_a_fresh_venv_from_pyproject_alone(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    torch = f"torch=={md.version('torch').split('+')[0]}"  # this machine's wheel, not a CUDA download
    subprocess.run(pip + [torch], check=True, timeout=900)
    subprocess.run(pip + [str(ROOT)], check=True, timeout=900)  # a regular (non-editable) install: no extras
    code = ("import importlib, pkgutil, tandem\n"
            "mods = [m.name for m in pkgutil.walk_packages(tandem.__path__, 'tandem.')]\n"
            "for m in mods: importlib.import_module(m)\n"
            "print(len(mods))\n")
    r = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, timeout=600,
                       cwd=tmp_path)  # not ROOT: the installed package, not the checkout
    assert r.returncode == 0, r.stderr[-3000:]
    assert int(r.stdout) > 50
    r = subprocess.run([str(venv / "bin" / "tandem"), "frobnicate"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
