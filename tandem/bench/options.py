"""Typed options of `tandem bench comm`, parsed and validated before any process starts."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from tandem.core.errors import ConfigError
from tandem.core.units import format_size

# Names only: importing tandem.bench.collectives would pull torch into every `tandem` start-up.
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce", "sendrecv")
DTYPES = ("fp32", "bf16", "fp16", "fp64", "int32")

MODES = ("both", "out", "in")


@dataclass
class CommOptions:
    collectives: list[str] = field(default_factory=lambda: ["all_reduce"])
    min_bytes: int = 8
    max_bytes: int = 64 << 20
    factor: int = 2
    dtype: str = "fp32"
    warmup: int = 5
    iters: int = 20
    mode: str = "both"          # both | out | in (in-place), as nccl-tests' two column groups
    check: bool = True          # verify every (collective, size, mode) result
    compute: bool = True        # time a matmul on rank 0 for the calibration's achieved FLOP/s
    device: str = "auto"        # auto | cpu | cuda (the worker resolves auto)
    backend: str = "auto"       # auto | gloo | nccl

    def sizes(self) -> list[int]:
        out, s = [], self.min_bytes
        while s <= self.max_bytes:
            out.append(s)
            s *= self.factor
        return out

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "CommOptions":
        return cls(**{k: v for k, v in d.items() if k in {f.name for f in dataclasses.fields(cls)}})

    def validate(self) -> "CommOptions":
        if self.collectives == ["all"]:
            self.collectives = list(COLLECTIVES)
        for c in self.collectives:
            if c not in COLLECTIVES:
                raise ConfigError(f"unknown collective {c!r}", field="--collectives", value=c,
                                  fix=f"choose from {', '.join(COLLECTIVES)} (or 'all')")
        if self.dtype not in DTYPES:
            raise ConfigError(f"unknown dtype {self.dtype!r}", field="--dtype", value=self.dtype,
                              fix=f"choose from {', '.join(DTYPES)}")
        if self.min_bytes < 1 or self.max_bytes < self.min_bytes:
            raise ConfigError("size range is empty", field="--max-bytes",
                              value=f"{self.min_bytes}..{self.max_bytes}",
                              fix="give 1 <= --min-bytes <= --max-bytes")
        if self.factor < 2:
            raise ConfigError("size factor must be at least 2", field="--factor", value=self.factor,
                              fix="use --factor 2 (nccl-tests' -f 2)")
        if self.iters < 1 or self.warmup < 0:
            raise ConfigError("need at least one timed iteration and no negative warm-up",
                              field="--iters", value=(self.warmup, self.iters),
                              fix="e.g. --warmup 5 --iters 20")
        if self.mode not in MODES:
            raise ConfigError(f"unknown mode {self.mode!r}", field="--mode", value=self.mode, fix="both | out | in")
        return self


def buffer_bytes_per_rank(opts: CommOptions) -> int:
    """Peak memory one worker needs at the largest size.

    The fattest collective holds an input and an output of the full size
    (all_to_all, out-of-place all_reduce), plus fill/check temporaries bounded
    by BLOCK; 2x size plus 64 MiB of slack covers every collective here.
    """
    return 2 * opts.max_bytes + (64 << 20)


def check_memory(opts: CommOptions, procs_on_this_host: int, available: int | None) -> None:
    """Refuse sizes that cannot fit before starting processes (CPU: MemAvailable; CUDA: the worker checks)."""
    if available is None:
        return
    need = buffer_bytes_per_rank(opts) * procs_on_this_host
    if need > available:
        raise ConfigError(
            f"sizes up to {format_size(opts.max_bytes)} need about {need / 2**30:.1f} GiB on this host "
            f"({procs_on_this_host} workers x 2 buffers) but {available / 2**30:.1f} GiB is available",
            field="--max-bytes", value=format_size(opts.max_bytes),
            fix="lower --max-bytes or run fewer workers per node")


def mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
