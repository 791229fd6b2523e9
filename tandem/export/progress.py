"""A progress bar over bytes written, on stderr (off for --json or when asked)."""

from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def bar(total: int, show: bool):
    if not show:
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                               TransferSpeedColumn)

    with Progress(TextColumn("export"), BarColumn(), DownloadColumn(binary_units=True), TransferSpeedColumn(),
                  TimeRemainingColumn(), console=Console(stderr=True), transient=True) as p:
        task = p.add_task("export", total=total)
        yield lambda n: p.advance(task, n)
