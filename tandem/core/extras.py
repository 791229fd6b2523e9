"""The extras of pyproject.toml that a stage needs, and the one-line error when one is missing.

A training job installs torch and little else; serving's HTTP stack and scikit-learn's bundled
data sets come with their extras. A stage calls ``require(extra, what)`` where it first needs one,
before the import that would fail, so the user reads which extra to install instead of a traceback.
"""

from __future__ import annotations

import importlib.util

from tandem.core.errors import ConfigError

# The modules each extra must provide (import names, not distributions: scikit-learn is sklearn).
# tests/core/test_dependencies.py holds this table to pyproject.toml. httptools and uvloop are
# the front's faster parser and event loop, used when present: not required here.
MODULES: dict[str, tuple[str, ...]] = {
    # tandem serve's HTTP front, its request models and metrics; httpx: `tandem bench serve`'s client;
    # tokenizers and jinja2: the OpenAI routes' text (an export's tokenizer.json) and chat templates
    "serve": ("fastapi", "starlette", "uvicorn", "pydantic", "prometheus_client", "httpx", "tokenizers", "jinja2"),
    # scikit-learn's bundled data sets: digits (data.name = "digits", tandem demo), examples/own_data.py
    "examples": ("sklearn",),
}


def require(extra: str, what: str) -> None:
    """ConfigError (exit 2) naming ``extra`` when one of its modules cannot be imported here.
    ``what`` says who needs it: "tandem serve", "the digits data set"."""
    for module in MODULES[extra]:
        if not _importable(module):
            raise ConfigError(f"{what} needs the '{extra}' extra ({module} is not installed)",
                              fix=f"pip install 'tandem[{extra}]'")


def _importable(module: str) -> bool:
    try:  # finds it without importing it (importing sklearn costs more than a small job's data path)
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a finder that refuses it, a half-imported module
        return False
