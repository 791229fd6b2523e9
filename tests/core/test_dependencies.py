"""Every module the package imports is declared in pyproject.toml (the click that typer stopped
installing crashed every usage error), checked two ways: statically over every import
statement (fast), and by importing every module in a fresh venv made from pyproject alone (slow).
A stage's own packages are extras (serve, examples: tandem/core/extras.py): the core verbs run
without them, and a verb that needs a missing one says which in one line, exit 2."""

import ast
import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tandem_testing import ROOT, one_line_error, run_tandem

PKG = ROOT / "tandem"


def _declared() -> tuple[set[str], set[str]]:
    """(required distributions, distributions of the extras), normalised names."""
    proj = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    name = lambda req: re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0].lower().replace("_", "-")  # noqa: E731
    extras = {name(r) for reqs in proj.get("optional-dependencies", {}).values() for r in reqs}
    return {name(r) for r in proj["dependencies"]}, extras


def _imports(path) -> list[tuple[str, bool, frozenset[str]]]:
    """(top-level module, at module level?, the extras a module-level ``require(EXTRA, ...)`` checked
    before it) for every import in a file. Imports inside a function or a try block may be optional
    features; at module level they are required, unless the module first checked for their extra
    (tandem/core/extras.py: the module belongs to that extra, and says so in one line without it)."""
    tree = ast.parse(path.read_text())
    found = []
    guards: set[str] = set()

    def visit(node, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Try))
            if isinstance(child, ast.Import):
                found.extend((a.name.split(".")[0], top, frozenset(guards)) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                found.append((child.module.split(".")[0], top, frozenset(guards)))
            elif (top and node is tree and isinstance(child, ast.Expr) and isinstance(child.value, ast.Call)
                  and getattr(child.value.func, "id", None) == "require" and child.value.args
                  and isinstance(child.value.args[0], ast.Constant)):
                guards.add(child.value.args[0].value)
            visit(child, nested)

    visit(tree, True)
    return found


def test_every_imported_distribution_is_declared():
    from tandem.core.extras import MODULES

    required, extras = _declared()
    dists = {k: {d.lower().replace("_", "-") for d in v} for k, v in md.packages_distributions().items()}
    problems = []
    for f in sorted(PKG.rglob("*.py")):
        for mod, top, guards in _imports(f):
            if mod in sys.stdlib_module_names or mod in ("tandem", "__future__"):
                continue
            owners = dists.get(mod)
            where = f"{f.relative_to(ROOT)} imports {mod}"
            if not owners:
                problems.append(f"{where}: installed by no distribution here (undeclared, or from another package)")
            elif top and not owners & required and not any(mod in MODULES.get(e, ()) for e in guards):
                problems.append(f"{where} at module level: {sorted(owners)} is not in [project].dependencies"
                                f" (nor checked first by a module-level require() of an extra that holds it)")
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
    # Every module imports, but those of an extra (tandem/core/extras.py), which say which in one line.
    code = ("import importlib, json, pkgutil, tandem\n"
            "from tandem.core.errors import ConfigError\n"
            "mods = [m.name for m in pkgutil.walk_packages(tandem.__path__, 'tandem.')]\n"
            "extra = {}\n"
            "for m in mods:\n"
            "    try: importlib.import_module(m)\n"
            "    except ConfigError as e: extra[m] = str(e)\n"
            "print(json.dumps({'n': len(mods), 'extra': extra}))\n")
    r = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, timeout=600,
                       cwd=tmp_path)  # not ROOT: the installed package, not the checkout
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    assert got["n"] > 50
    assert got["extra"] and all(m.startswith("tandem.serve.") for m in got["extra"]), got["extra"]
    for m, msg in got["extra"].items():
        assert "needs the 'serve' extra" in msg and "pip install 'tandem[serve]'" in msg, (m, msg)
    r = subprocess.run([str(venv / "bin" / "tandem"), "frobnicate"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "config.json").write_text("{}\n")
    r = subprocess.run([str(venv / "bin" / "tandem"), "serve", "export"], capture_output=True, text=True,
                       cwd=tmp_path)
    one_line_error(r, "tandem serve needs the 'serve' extra", "Fix: pip install 'tandem[serve]'")


# --- extras: a stage's packages, and the one line a verb gives when its extra is missing -------------

FASTER_WHEN_PRESENT = {"httptools", "uvloop"}  # the serve front's C parser and event loop: used if there


def _blocking(tmp_path: Path, *modules: str) -> dict:
    """An environment whose interpreters (this one's children and theirs: the workers) cannot import
    ``modules``, as where their distributions are not installed: a sitecustomize that marks each one
    absent in sys.modules, which makes `import` raise ModuleNotFoundError and find_spec answer None."""
    site = tmp_path / "blocked"
    site.mkdir()
    (site / "sitecustomize.py").write_text(f"import sys\nfor m in {sorted(modules)!r}:\n    sys.modules[m] = None\n")
    return {"PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}


def test_every_extra_module_comes_from_its_extra():
    """core/extras.MODULES against pyproject.toml: each module is installed by a distribution of its
    extra, and each distribution of the extra installs one of its modules (or only speeds one up)."""
    from tandem.core.extras import MODULES

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    name = lambda req: re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0].lower().replace("_", "-")  # noqa: E731
    dists = {k: {d.lower().replace("_", "-") for d in v} for k, v in md.packages_distributions().items()}
    for extra, modules in MODULES.items():
        declared = {name(r) for r in extras[extra]}
        provided = set().union(*(dists.get(m, set()) for m in modules))
        for m in modules:
            assert dists.get(m, set()) & declared, f"{m} is installed by no distribution of the {extra!r} extra"
        assert declared - FASTER_WHEN_PRESENT <= provided, (extra, declared - provided)
    for extra in ("test", "ray"):  # the suite and the Ray engine serve: the serve extra comes with them
        assert any(r.startswith("tandem[") and "serve" in r for r in extras[extra]), extra


def test_core_dependencies_hold_no_stage_extra():
    """A training job installs neither the serving stack nor scikit-learn."""
    from tandem.core.extras import MODULES

    required, _ = _declared()
    dists = {k: {d.lower().replace("_", "-") for d in v} for k, v in md.packages_distributions().items()}
    for extra, modules in MODULES.items():
        for m in modules:
            assert not dists.get(m, set()) & required, f"{m} ({extra!r} extra) is in [project].dependencies"


def _core_closure() -> set[str]:
    """The distributions a core install brings: [project].dependencies and what they require, as installed
    here (typer >= 0.24 requires pydantic, for one)."""
    seen, todo = set(), list(_declared()[0])
    while todo:
        d = todo.pop()
        if d in seen:
            continue
        seen.add(d)
        try:
            reqs = md.requires(d) or []
        except md.PackageNotFoundError:
            continue
        todo += [re.split(r"[<>=!~\[; (]", r, maxsplit=1)[0].lower().replace("_", "-") for r in reqs
                 if "extra ==" not in r]
    return seen


def test_the_core_verbs_need_no_extra(tmp_path):
    """--help, a plan and a job spec check run with every extra's module absent that a core install lacks."""
    from tandem.core.extras import MODULES

    core = _core_closure()
    dists = {k: {d.lower().replace("_", "-") for d in v} for k, v in md.packages_distributions().items()}
    absent = [m for ms in MODULES.values() for m in ms if not dists.get(m, set()) & core]
    assert "fastapi" in absent and "sklearn" in absent, absent
    env = _blocking(tmp_path, *absent)
    for args in (["--help"], ["serve", "--help"], ["plan", "llama2-7b"], ["spec", "examples/gpt_reverse.toml"]):
        r = run_tandem(*args, env=env)
        assert r.returncode == 0 and "Traceback" not in r.stderr, (args, r.stdout[-2000:], r.stderr[-3000:])


@pytest.mark.parametrize("blocked,args,words", [
    (("fastapi",), ["serve", "{export}"], ["tandem serve needs the 'serve' extra (fastapi is not installed)",
                                           "Fix: pip install 'tandem[serve]'"]),
    (("prometheus_client",), ["serve", "{export}"], ["tandem serve needs the 'serve' extra",
                                                     "pip install 'tandem[serve]'"]),
    (("httpx",), ["bench", "serve", "http://127.0.0.1:9"], ["tandem bench serve needs the 'serve' extra "
                                                            "(httpx is not installed)", "pip install 'tandem[serve]'"]),
    (("sklearn",), ["spec", "examples/digits_resnet.toml"],
     ["the digits data set", "needs the 'examples' extra (sklearn is not installed)",
      "Fix: pip install 'tandem[examples]'"]),
    (("sklearn",), ["train", "examples/digits_resnet.toml"], ["needs the 'examples' extra"]),
    (("sklearn",), ["spec", "examples/own_data.toml"],
     ["examples/own_data.py needs the 'examples' extra", "pip install 'tandem[examples]'"]),
], ids=["serve-fastapi", "serve-metrics", "bench-serve", "spec-digits", "train-digits", "own-data"])
def test_a_missing_extra_is_one_line_naming_it(tmp_path, blocked, args, words):
    export = tmp_path / "export"
    export.mkdir()
    (export / "config.json").write_text('{"kind": "gpt"}\n')
    r = run_tandem(*(a.format(export=export) for a in args), env=_blocking(tmp_path, *blocked),
                   cwd=tmp_path if args[0] == "serve" else ROOT)
    one_line_error(r, *words)
