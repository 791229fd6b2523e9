"""NodeRange: ``launch.nnodes`` as numbers.

A job spec (and torchrun's ``--nnodes``) writes the nodes as text: ``N`` for a fixed job, ``MIN:MAX``
for an elastic one. ``NodeRange.parse`` turns it into numbers once, with the one-line error a spec
or command line gets; ``str`` gives torchrun's text back.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.core.errors import ConfigError


@dataclass(frozen=True)
class NodeRange:
    min: int
    max: int

    @classmethod
    def parse(cls, nnodes: str, field: str = "launch.nnodes") -> NodeRange:
        """'2' -> NodeRange(2, 2); '1:4' -> NodeRange(1, 4)."""
        try:
            lo, _, hi = str(nnodes).partition(":")
            mn, mx = int(lo), int(hi or lo)
        except ValueError:
            raise ConfigError("expected N or MIN:MAX", field=field, value=nnodes,
                              fix="write --nnodes 2 or --nnodes 1:4") from None
        if mn < 1 or mx < mn:
            raise ConfigError(f"{nnodes!r} is not a valid range (need 1 <= MIN <= MAX)",
                              field=field, fix="write --nnodes 2 or --nnodes 1:4")
        return cls(mn, mx)

    @property
    def elastic(self) -> bool:
        """Nodes may come and go between MIN and MAX (a c10d rendezvous that re-forms the group)."""
        return self.min != self.max

    def __str__(self) -> str:
        return f"{self.min}:{self.max}" if self.elastic else str(self.min)
