"""A safetensors file written one tensor at a time, its header laid out before any data.

The format (https://huggingface.co/docs/safetensors): 8 bytes little-endian header length N,
N bytes of JSON ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``
padded with spaces to a multiple of 8, then the tensors' bytes back to back. The safetensors
library builds a whole state dict in memory before it writes; here the header comes from the
shapes alone (DCP's metadata), so each tensor can be written as soon as it is read and dropped.

Layout is deterministic: tensors ordered by element size (largest first, so every tensor
starts on a multiple of its element size, as safetensors' own writer does), then by name;
the JSON keys sorted. The same tensors give the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

# safetensors' dtype codes
CODES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
         torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
         torch.bool: "BOOL"}
DTYPES = {v: k for k, v in CODES.items()}


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


def order(entries: list[Entry]) -> list[Entry]:
    return sorted(entries, key=lambda e: (-e.itemsize, e.name))


def header(entries: list[Entry], metadata: dict[str, str]) -> bytes:
    """The 8-byte length and the padded JSON header for ``entries`` in file order."""
    table: dict = {"__metadata__": dict(sorted(metadata.items()))}
    off = 0
    for e in entries:
        table[e.name] = {"dtype": CODES[e.dtype], "shape": list(e.shape), "data_offsets": [off, off + e.nbytes]}
        off += e.nbytes
    text = json.dumps(table, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes, little-endian, without a copy when it is already contiguous."""
    t = t.detach().contiguous()
    if t.dim() == 0:
        t = t.reshape(1)
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


class StreamFile:
    """Write the tensors of ``entries`` in their file order; hashes the file as it goes."""

    def __init__(self, path: Path, entries: list[Entry], metadata: dict[str, str]):
        self.path, self.entries = Path(path), order(entries)
        self._next = 0
        self._sha = hashlib.sha256()
        self._f = open(self.path, "wb")
        self._put(header(self.entries, metadata))

    def _put(self, data) -> None:
        self._f.write(data)
        self._sha.update(data)

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    def write(self, name: str, t: torch.Tensor) -> str:
        """Write the next tensor (it must be the next in file order); returns its bytes' sha256."""
        e = self.entries[self._next]
        if name != e.name or t.dtype != e.dtype or tuple(t.shape) != e.shape:
            raise AssertionError(f"{self.path.name}: expected {e.name} {e.dtype} {e.shape}, "
                                 f"got {name} {t.dtype} {tuple(t.shape)}")
        data = tensor_bytes(t)
        self._put(data)
        self._next += 1
        return hashlib.sha256(data).hexdigest()

    def close(self) -> dict:
        """Flush to disk; returns {"bytes", "sha256"} of the whole file."""
        if self._next != len(self.entries):
            raise AssertionError(f"{self.path.name}: {len(self.entries) - self._next} tensor(s) never written")
        self._f.flush()
        os.fsync(self._f.fileno())
        size = self._f.tell()
        self._f.close()
        return {"bytes": size, "sha256": self._sha.hexdigest()}

    def abort(self) -> None:
        if not self._f.closed:
            self._f.close()
