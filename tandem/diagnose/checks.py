"""The result type of every doctor check, and its table/JSON rendering."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from rich.console import Console

from tandem.core.errors import TandemError
from rich.table import Table

PASS, WARN, FAIL, INFO = "pass", "warn", "fail", "info"
_STYLE = {PASS: "green", WARN: "yellow", FAIL: "bold red", INFO: "dim"}


@dataclass
class Check:
    name: str
    status: str            # pass | warn | fail | info
    detail: str
    fix: str = ""          # required for warn and fail: what to do about it
    node: str = ""         # which node it ran on ("" = this machine)

    def __post_init__(self) -> None:
        if self.status in (WARN, FAIL) and not self.fix:
            raise ValueError(f"check {self.name!r} is {self.status} without a fix")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Check":
        return cls(**d)


class ChecksFailed(TandemError):
    """At least one check failed; the table above says which and how to fix it."""

    exit_code = 1


def worst(checks: list[Check]) -> str:
    order = [INFO, PASS, WARN, FAIL]
    return max((c.status for c in checks), key=order.index, default=PASS)


def table(checks: list[Check], title: str = "tandem doctor") -> Table:
    show_node = any(c.node for c in checks)
    t = Table(title=title, title_justify="left", header_style="bold", show_lines=False)
    if show_node:
        t.add_column("node", no_wrap=True)
    t.add_column("check", no_wrap=True)
    t.add_column("status", no_wrap=True)
    t.add_column("detail")
    t.add_column("fix")
    for c in checks:
        cells = [c.name, f"[{_STYLE[c.status]}]{c.status}[/]", c.detail, c.fix]
        t.add_row(*([c.node] if show_node else []), *cells)
    return t


def print_summary(checks: list[Check], console: Console) -> None:
    counts = {s: sum(c.status == s for c in checks) for s in (PASS, WARN, FAIL)}
    style = _STYLE[worst(checks)] if worst(checks) in (WARN, FAIL) else "green"
    console.print(f"[{style}]{counts[PASS]} pass, {counts[WARN]} warn, {counts[FAIL]} fail[/]")
