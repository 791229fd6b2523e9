"""`tandem diagnose RUN_DIR`: read a run's profiler window on every rank and say where the step goes
(the diagnosis is tandem/diagnose/diagnosis.py's; here the flags, the extra files asked for, the report)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console


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
    # the analysis loads when a run is diagnosed, not at every `tandem` start
    from tandem.diagnose.diagnosis import diagnose_run, write_diagnosis
    from tandem.diagnose.report import merged_trace, render

    traces, rep = diagnose_run(run_dir, calibration, nccl_log)
    if not rep["steps"]:  # no profiler window: the hangs and the NCCL log alone
        write_diagnosis(run_dir, rep)
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

        other = diagnose_run(compare, calibration)[1]
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
    out = write_diagnosis(run_dir, rep)
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
