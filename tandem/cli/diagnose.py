"""`tandem diagnose RUN_DIR`: read a run's profiler window on every rank and say where the step goes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from tandem.core.errors import DataError
from tandem.core import rundir


def diagnose_cmd(
    run_dir: Path = typer.Argument(..., help="A run dir trained with --profile.enabled true."),
    as_json: bool = typer.Option(False, "--json", help="Print diagnose.json instead of the report."),
    trace: Optional[Path] = typer.Option(None, "--trace", help="Also write the ranks' traces merged on one "
                                         "clock, one process per rank (Chrome/Perfetto; .gz compresses)."),
    hta_dir: Optional[Path] = typer.Option(None, "--hta", help="Also write each rank's trace on the aligned "
                                           "clock into this folder, with its rank: what Holistic Trace "
                                           "Analysis reads (TraceAnalysis(trace_dir=...); GPU runs)."),
    html_out: Optional[Path] = typer.Option(None, "--html", help="Also write a self-contained HTML page: one "
                                            "step's timeline per rank, shares, memory, verdicts."),
    compare: Optional[Path] = typer.Option(None, "--compare", help="A second profiled run (after a change): "
                                           "print both side by side."),
    calibration: Optional[Path] = typer.Option(None, "--calibration", help="A calibration from `tandem bench "
                                               "train`: the FLOP/s the planner expects, for the efficiency verdict."),
    nccl_log: Optional[Path] = typer.Option(None, "--nccl-log", help="An NCCL_DEBUG=INFO log of this run: "
                                            "transports, rings/trees and known bad signs in the report."),
) -> None:
    """Where each rank's step goes (data, compute, exposed communication, idle), which rank and section
    is slow, and what to change. Writes RUN_DIR/diagnose.json."""
    from tandem.diagnose.report import merged_trace, render

    traces, rep = _analyze(run_dir, calibration, nccl_log)
    if not rep["steps"]:  # no profiler window: the hangs and the NCCL log alone
        _write(run_dir, rep)
        if as_json:
            print(json.dumps(rep, indent=1))
            return
        from tandem.diagnose import incidents
        from tandem.diagnose.report import render_verdicts

        console = Console()
        console.print(f"[bold]tandem diagnose[/] {run_dir}: no profiler window (train with --profile.enabled true "
                      "for where the step goes)", highlight=False)
        incidents.render(rep, console)
        render_verdicts(rep, console)
        console.print(f"written: {run_dir / 'diagnose.json'}", highlight=False)
        return
    if compare is not None:
        from tandem.diagnose import compare as cmp

        other = _analyze(compare, calibration)[1]
        cmp.render(rep, other, (str(run_dir), str(compare)), Console())
        return
    if trace is not None:
        size = merged_trace(traces, {int(k): v for k, v in rep["clock"]["offsets_us"].items()}, trace)
        rep["merged_trace"] = {"path": str(trace), "bytes": size}
    if hta_dir is not None:
        from tandem.diagnose.report import hta_traces

        size = hta_traces(traces, {int(k): v for k, v in rep["clock"]["offsets_us"].items()}, hta_dir)
        rep["hta_traces"] = {"dir": str(hta_dir), "bytes": size, "gpu": any(t.has_gpu for t in traces)}
    if html_out is not None:
        from tandem.diagnose import html

        html.write(rep, traces, html_out)
    out = _write(run_dir, rep)
    if as_json:
        print(json.dumps(rep, indent=1))
        return
    console = Console()
    render(rep, console)
    if trace is not None:
        console.print(f"merged trace: {trace} ({rep['merged_trace']['bytes'] / 1e6:.2f} MB); open it in "
                      "ui.perfetto.dev or chrome://tracing", highlight=False)
    if hta_dir is not None:
        h = rep["hta_traces"]
        console.print(f"HTA traces: {hta_dir}/rank-*.json.gz ({h['bytes'] / 1e6:.2f} MB); "
                      + ("TraceAnalysis(trace_dir=...) reads them" if h["gpu"] else
                         "no GPU kernels in them: HTA's analyses keep only GPU kernels, so they will be empty"),
                      highlight=False)
    if html_out is not None:
        console.print(f"html report: {html_out}", highlight=False)
    console.print(f"written: {out}", highlight=False)


def _write(run_dir: Path, rep: dict) -> Path:
    out = run_dir / "diagnose.json"
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(rep, indent=1))
    tmp.replace(out)
    return out


def _analyze(run_dir: Path, calibration: Path | None = None, nccl_log: Path | None = None):
    from tandem.diagnose import incidents
    from tandem.diagnose.analyze import SCHEMA, analyze
    from tandem.diagnose.trace import load_run

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
