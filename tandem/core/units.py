"""Byte sizes as people write them on a command line (8, 64K, 16M, 1GiB) and back.

Here because several stages take a size flag (bench comm's -b/-e, doctor's --busbw-size, export's
--max-memory/--shard-size) and none of them should reach into another for the parser.
"""

from __future__ import annotations

import re

from tandem.core.errors import ConfigError

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
          "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def parse_size(text: str, field_name: str = "size") -> int:
    """'8', '64K', '1M', '1GiB' -> bytes (binary units, as nccl-tests' -b/-e)."""
    m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS:
        raise ConfigError(f"{text!r} is not a size", field=field_name, value=text,
                          fix="write a byte count with an optional unit: 8, 64K, 16M, 1G")
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


def format_size(n: int) -> str:
    for unit, mult in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= mult and n % mult == 0:
            return f"{n // mult}{unit}"
    return f"{n}B" if n < 1024 else f"{n / 1024:.1f}K"
