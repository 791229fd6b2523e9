"""RUN_DIR/submit/job.json: what was submitted, and where the engine keeps it.

Every engine writes one (its ``engine`` key names it, which is how `tandem status`,
`tandem cancel` and `tandem logs` find the engine again); the rest of the keys are the
engine's own. Writes are atomic: `tandem status` may read the record while the submitting
process (an ssh job's or a Ray job's driver) rewrites it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tandem.core.errors import ConfigError

SUBMIT_DIR = "submit"
RECORD = "job.json"


def submit_dir(run_dir: Path) -> Path:
    return Path(run_dir) / SUBMIT_DIR


def read_record(run_dir: Path) -> dict:
    path = submit_dir(run_dir) / RECORD
    if not path.is_file():
        raise ConfigError("no submitted job here", field="run_dir", value=str(run_dir),
                          fix="give the --run-dir of a `tandem submit` (it holds submit/job.json)")
    return json.loads(path.read_text())


def write_record(run_dir: Path, rec: dict) -> dict:
    """The whole record, replaced at once."""
    sub = submit_dir(run_dir)
    sub.mkdir(parents=True, exist_ok=True)
    tmp = sub / f".{RECORD}.{os.getpid()}"
    tmp.write_text(json.dumps(rec, indent=1, default=str) + "\n")
    tmp.replace(sub / RECORD)
    return rec


def update_record(run_dir: Path, /, **fields) -> dict:
    """The record with ``fields`` set (a new one when there is none yet)."""
    path = submit_dir(run_dir) / RECORD
    return write_record(run_dir, {**(json.loads(path.read_text()) if path.is_file() else {}), **fields})
