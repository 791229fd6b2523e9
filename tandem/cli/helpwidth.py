"""``--help`` that keeps every word: typer renders help as rich tables, whose cells end in '…' where a
column is too narrow, and rich assumes 80 columns when the output is not a terminal (a pipe, a file, a
pager), so `tandem plan --help | less` showed `--overlap-param-ga…`.

Two changes, made by main() before it parses the command line: output that is not a terminal, with no width
asked for (COLUMNS, or typer's TERMINAL_WIDTH), is laid out PIPE_WIDTH wide, where every verb's table fits;
and every help table (and each flag's help text) folds what does not fit onto the next line instead of
cutting it, so a narrow terminal wraps a long flag name but loses no character of it. Touches typer's
help only, by its module attributes; a typer without them is left as it is."""

from __future__ import annotations

import os
import sys

from rich.table import Table
from rich.text import Text

PIPE_WIDTH = 120
_UNSET = object()
_ASKED = _UNSET


class FoldingTable(Table):
    """rich's Table whose columns fold (wrap what does not fit onto the next line) rather than end in '…'."""

    def add_column(self, *args, **kwargs):
        kwargs["overflow"] = "fold"
        super().add_column(*args, **kwargs)

    def add_row(self, *renderables, **kwargs):
        super().add_row(*renderables, **kwargs)  # columns made here take rich's default: fold them too
        for column in self.columns:
            column.overflow = "fold"


def keep_help_words() -> None:
    try:
        from typer import rich_utils
    except ImportError:
        return
    if not hasattr(rich_utils, "Table") or not hasattr(rich_utils, "MAX_WIDTH"):
        return
    global _ASKED
    if _ASKED is _UNSET:
        _ASKED = rich_utils.MAX_WIDTH  # TERMINAL_WIDTH, as typer read it at import (None: not given)
    # decided at each call (main() may run more than once in a process, as the tests run it)
    piped = _ASKED is None and not os.environ.get("COLUMNS") and not _is_terminal()
    rich_utils.MAX_WIDTH = PIPE_WIDTH if piped else _ASKED
    rich_utils.Table = FoldingTable
    make_text = getattr(rich_utils, "_make_rich_text", None)
    if make_text is not None and not getattr(make_text, "folds", False):
        def folding_text(*args, **kwargs):  # a flag's help sits in rich Columns, a grid of its own: fold the text
            text = make_text(*args, **kwargs)
            if isinstance(text, Text):
                text.overflow = "fold"
            return text

        folding_text.folds = True
        rich_utils._make_rich_text = folding_text


def _is_terminal() -> bool:
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):  # replaced or closed stdout
        return False
