"""A run dir's diagnosis: its ranks' traces read, analyzed and joined with its incidents; diagnose.json."""

from __future__ import annotations

import json
from pathlib import Path

from tandem.core import rundir
from tandem.core.errors import DataError
from tandem.diagnose import incidents
from tandem.diagnose.analyze import SCHEMA, analyze
from tandem.diagnose.trace import load_run


def write_diagnosis(run_dir: Path, rep: dict) -> Path:
    """RUN_DIR/diagnose.json, whole or not at all."""
    out = run_dir / "diagnose.json"
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(rep, indent=1))
    tmp.replace(out)
    return out


def diagnose_run(run_dir: Path, calibration: Path | None = None, nccl_log: Path | None = None):
    """Every rank's trace of the run and the report on them (analyze.py), with its hangs and NCCL log
    (incidents.py); a run with no profiler window but hangs or a log gets the report of those alone."""
    if not run_dir.is_dir():
        raise DataError("run dir not found", field="run_dir", value=str(run_dir),
                        fix="give the run_dir of a finished tandem train run")
    story = {"hangs": incidents.hangs(run_dir), "nccl": incidents.nccl(nccl_log) if nccl_log else None}
    if not (run_dir / "profile").is_dir() and (story["hangs"] or story["nccl"]):
        rep = {"schema": SCHEMA, "run_dir": str(run_dir), "world": None, "steps": [], **story}
        rep["verdicts"] = incidents.verdicts(rep)
        return [], rep
    traces = load_run(run_dir)
    spec_p = run_dir / rundir.SPEC
    spec = json.loads(spec_p.read_text()) if spec_p.exists() else None
    if calibration is not None and not calibration.is_file():
        raise DataError("no such file", field="calibration", value=str(calibration),
                        fix="give the calibration.json that `tandem bench train` wrote")
    rep = analyze(traces, spec, run_dir, str(calibration) if calibration else None)
    rep.update(story)
    rep["verdicts"] += incidents.verdicts(rep)
    if not rep["steps"]:
        raise DataError("the ranks' windows share no step", field="run_dir", value=str(run_dir),
                        fix="profile again: every rank must record the same steps")
    return traces, rep
