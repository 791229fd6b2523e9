"""Checkpoint manifests: the size and sha256 of every file, checked before a load.

``<ckpt>/manifest.json``::

    {"version": 1, "step": 120, "files": {"__0_0.distcp": {"bytes": 81234, "sha256": "..."}, ...}}

Rank 0 writes it after every rank finished writing and before the folder is renamed
to its final name, so a published checkpoint always has one. ``verify`` names the
first file that is missing, truncated or altered; ``latest`` in checkpoint.py skips
such a checkpoint and falls back to the previous one, an explicit resume refuses it.
Checkpoints written before manifests existed (no manifest.json) load unverified.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from tandem.core.errors import CheckpointError

NAME = "manifest.json"


def sha256(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def write(folder: Path, step: int) -> Path:
    """Hash every file of ``folder`` (the manifest itself excepted) into manifest.json."""
    folder = Path(folder)
    files = {p.name: {"bytes": p.stat().st_size, "sha256": sha256(p)}
             for p in sorted(folder.iterdir()) if p.is_file() and p.name != NAME}
    tmp = folder / (NAME + ".tmp")
    tmp.write_text(json.dumps({"version": 1, "step": step, "files": files}, indent=1))
    os.replace(tmp, folder / NAME)
    return folder / NAME


_CACHE: dict[tuple, str | None] = {}


def problem(folder: Path) -> str | None:
    """None when every file matches the manifest (or there is none), else what is wrong.

    Results are cached per (file, size, mtime) so that choosing and then loading a
    checkpoint hashes it once."""
    folder = Path(folder)
    try:
        key = (str(folder), tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.iterdir())))
    except FileNotFoundError:
        return f"{folder.name} vanished"
    if key not in _CACHE:
        _CACHE[key] = _problem(folder)
    return _CACHE[key]


def _problem(folder: Path) -> str | None:
    path = folder / NAME
    if not path.is_file():
        return None
    try:
        files = json.loads(path.read_text())["files"]
    except (json.JSONDecodeError, KeyError) as e:
        return f"manifest.json is unreadable ({type(e).__name__})"
    for name, want in files.items():
        p = folder / name
        if not p.is_file():
            return f"{name} is missing"
        size = p.stat().st_size
        if size != want["bytes"]:
            return f"{name} is truncated or altered: {size} bytes, manifest says {want['bytes']}"
        if sha256(p) != want["sha256"]:
            return f"{name} is altered: sha256 differs from the manifest ({want['sha256'][:12]}...)"
    return None


def verify(folder: Path) -> None:
    """Raise CheckpointError naming the bad file when the folder does not match its manifest."""
    bad = problem(folder)
    if bad:
        raise CheckpointError(f"checkpoint {Path(folder).name} failed its sha256 manifest: {bad}",
                              field="checkpoint.resume", value=str(folder),
                              fix="resume from an earlier checkpoint, or 'auto' (which falls back to the newest "
                                  "one that verifies)")
