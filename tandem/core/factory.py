"""Import a model factory given as 'pkg.module:factory', the same way for every verb.

`tandem train` runs its workers as ``python -m tandem.train.worker``, which puts the
current directory first on sys.path, so ``mymodels.py`` next to the job imports without
PYTHONPATH. The ``tandem`` console script itself (plan, spec, ...) gets its own bin
directory there instead; this helper gives it the current directory too, for the
import only, so a path that trains also plans.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Callable

from tandem.core.errors import ConfigError


def import_factory(path: str, *, field: str, valid: str) -> Callable:
    """The callable named by 'pkg.module:factory'; a ConfigError naming `field` if it is not there."""
    module_name, _, attr = path.partition(":")
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except Exception as e:  # ImportError, AttributeError, ValueError (':factory'), or the module's own error
        text = " ".join(str(e).split())
        text = text if len(text) <= 200 else text[:197] + "..."
        raise ConfigError(f"cannot import {path!r} ({type(e).__name__}: {text})", field=field, value=path,
                          fix=f"use {valid}, with the module in the current directory or on PYTHONPATH") from None
    finally:
        if added:
            sys.path.remove(cwd)
    if not callable(factory):
        raise ConfigError(f"{path!r} is a {type(factory).__name__}, not a callable", field=field, value=path,
                          fix="name a function or class that returns a torch.nn.Module")
    return factory
