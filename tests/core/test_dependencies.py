"""Every module the package imports is declared in pyproject.toml (the click that typer stopped
installing crashed every usage error), checked two ways: statically over every import
statement (fast), and by importing every module in a fresh venv made from pyproject alone (slow)."""

import ast
import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

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


def _link_torch(venv: Path) -> bool:
    """Hard-link this interpreter's installed torch (package folders and dist-info: what pip
    unpacked from the wheel) into the venv, instead of unpacking ~750 MB again (~25 s on 2 cores).
    torch is installed first and pinned anyway (the Makefile does it); what the test proves is that
    everything else comes from pyproject.toml, and pip still installs torch's own requirements.
    Links, not symlinks: whatever pip or Python does in the venv leaves the original files alone.
    False (nothing left behind) where it cannot link, e.g. across file systems."""
    dist = md.distribution("torch")
    tops = sorted({f.parts[0] for f in dist.files or [] if f.parts[0] != ".."})  # bin/ scripts: not needed
    where = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c", where], capture_output=True, text=True,
                               check=True).stdout.strip())
    made = []
    try:
        for top in tops:
            src = Path(dist.locate_file(top))
            if src.is_dir():
                shutil.copytree(src, site / top, copy_function=os.link, symlinks=True)
            elif src.is_file():
                os.link(src, site / top)
            made.append(site / top)
        return bool(made)
    except OSError:
        for m in made:
            shutil.rmtree(m) if m.is_dir() else m.unlink()
        return False


@pytest.mark.slow
def test_every_module_imports_in_a_fresh_venv_from_pyproject_alone(tmp_path):
    venv = tmp_path / "venv"
    # No pip in the venv (tandem does not need one): this interpreter's pip installs into it. No .pyc
    # compiled at install: the imports below compile what they load; the rest was ~20 s of CPU.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    pip = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
           "--disable-pip-version-check", "--no-compile"]
    torch = f"torch=={md.version('torch').split('+')[0]}"  # this machine's wheel, not a CUDA download
    _link_torch(venv)  # else pip unpacks the same wheel
    subprocess.run(pip + [torch], check=True, timeout=900)  # linked: only torch's own requirements
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
