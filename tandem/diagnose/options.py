"""Options of `tandem doctor`'s workers (no torch here: the CLI imports it at start-up)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DoctorOptions:
    device: str = "auto"
    nproc_per_node: int = 1
    checkpoint_path: str = "runs"
    shared_path: str = ""             # default: checkpoint_path
    busbw_bytes: int = 8 << 20
    expect_busbw_GBps: float = 0.0    # 0: no expectation, the number is reported only
    collective_timeout_s: float = 120.0
