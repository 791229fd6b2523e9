"""rich Consoles whose lines are whole when the output is a pipe or a file.

rich lays out for 80 columns when it cannot ask a terminal, so a progress line or a
verdict written to a log (`tandem train ... | tee train.log`, CI) is cut or wrapped at 80.
A log has no width: give it a wide one. A terminal keeps its own width, and COLUMNS, when
set, wins as rich's own rule says.
"""

from __future__ import annotations

import os
import sys

from rich.console import Console

LOG_WIDTH = 200  # wide enough for the longest progress line (bar 40 + counts + info ~ 140)


def make_console(*, stderr: bool = False, **kwargs) -> Console:
    """``Console(stderr=...)`` with ``width`` set to LOG_WIDTH when that stream is not a terminal."""
    stream = sys.stderr if stderr else sys.stdout
    piped = not (hasattr(stream, "isatty") and stream.isatty())
    if piped and not os.environ.get("COLUMNS") and "width" not in kwargs:
        kwargs["width"] = LOG_WIDTH
    return Console(stderr=stderr, **kwargs)
