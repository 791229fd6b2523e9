"""`tandem bench comm|train|serve`: the flags in, the measurement (tandem/bench/), the tables and files out."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from tandem.bench import fit, report
from tandem.bench.comm import comm_workers, measure
from tandem.bench.options import CommOptions, check_memory, mem_available
from tandem.bench.runner import procs_on_this_host
from tandem.bench.serve import bench_serve, print_report as print_load_report
from tandem.core.errors import ConfigError, WorkerFailure
from tandem.core.extras import require
from tandem.core.spec import LaunchSpec
from tandem.core.units import parse_size
from tandem.launch.options import check, launch_options

bench_app = typer.Typer(help="Measure collectives (nccl-tests style), training scaling and a served model under load; "
                        "calibrate `tandem plan`.",
                        no_args_is_help=True)

@launch_options("nproc_per_node", "nnodes", "node_rank", "master_addr", "master_port", "rdzv_endpoint",
                "simulate_nodes", "timeout", "device", "backend", nproc_per_node=(2, "Workers per node."),
                nnodes=("1", "Nodes (run this command on every node)."))
def comm_cmd(
    collectives: str = typer.Option("all_reduce", "--collectives", "-c",
                                    help="Comma list: all_reduce, all_gather, reduce_scatter, all_to_all, "
                                         "broadcast, reduce, sendrecv; or 'all'."),
    min_bytes: str = typer.Option("8", "--min-bytes", "-b", help="Smallest size (nccl-tests -b), e.g. 8, 1K."),
    max_bytes: str = typer.Option("64M", "--max-bytes", "-e", help="Largest size (nccl-tests -e), e.g. 64M, 1G."),
    factor: int = typer.Option(2, "--factor", "-f", help="Size multiplier between steps (nccl-tests -f)."),
    dtype: str = typer.Option("fp32", "--dtype", "-d", help="fp32 | bf16 | fp16 | fp64 | int32."),
    warmup: int = typer.Option(5, "--warmup", "-w", help="Untimed calls per size (nccl-tests -w)."),
    iters: int = typer.Option(20, "--iters", "-n", help="Timed calls per size (nccl-tests -n)."),
    mode: str = typer.Option("both", "--mode", help="both | out (out-of-place) | in (in-place)."),
    no_check: bool = typer.Option(False, "--no-check", help="Skip the correctness check (nccl-tests -c 0)."),
    no_compute: bool = typer.Option(False, "--no-compute", help="Skip the matmul FLOP/s measurement."),
    launch: LaunchSpec = None,
    run_dir: Path = typer.Option(Path("runs/bench-comm"), "--run-dir", help="Logs and raw results go here."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write results + fits as JSON."),
    csv_out: Optional[Path] = typer.Option(None, "--csv", help="Write one CSV row per measurement."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="PNG of busbw against size per collective."),
    calibration: Optional[Path] = typer.Option(None, "--calibration",
                                               help="Calibration file for `tandem plan` "
                                                    "(default: RUN_DIR/calibration.json)."),
) -> None:
    """Time collectives like nccl-tests: time, algbw, busbw, checked results, alpha-beta fit.

    Example: tandem bench comm -c all --nproc-per-node 2 --simulate-nodes 2 -e 16M --plot busbw.png
    """
    opts = CommOptions(collectives=[c.strip() for c in collectives.split(",") if c.strip()],
                       min_bytes=parse_size(min_bytes, "--min-bytes"),
                       max_bytes=parse_size(max_bytes, "--max-bytes"), factor=factor, dtype=dtype,
                       warmup=warmup, iters=iters, mode=mode, check=not no_check, compute=not no_compute,
                       device=launch.device, backend=launch.backend).validate()
    check(launch)  # before anything starts
    from tandem.core.validate import world_sizes

    if world_sizes(launch)[1] < 2:
        raise ConfigError("a collective needs at least 2 ranks", field="--nproc-per-node",
                          value=launch.nproc_per_node, fix="use --nproc-per-node 2 (or more nodes)")
    if launch.device != "cuda":  # GPU memory is checked by the worker, where the device is
        check_memory(opts, procs_on_this_host(launch), mem_available())
    result = measure(opts, launch, run_dir)
    # Piped output (CI logs, `| tee`) gets a fixed wide console so the nccl-tests columns never wrap.
    out = Console(width=None if sys.stdout.isatty() else 150)
    if result is None:
        out.print("this node did not host rank 0; results are on the node that did")
        return
    fitted = fit.fits(result)
    report.print_report(result, fitted, out)
    cal_path = calibration or run_dir / "calibration.json"
    fit.write_calibration(cal_path, result, fitted)
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps({**result, "fits": fitted}, indent=1))
    if csv_out:
        report.write_csv(csv_out, result)
    if plot:
        report.write_plot(plot, result)
    written = [str(p) for p in (cal_path, json_out, csv_out, plot) if p]
    out.print(f"wrote {', '.join(written)}", highlight=False)
    wrong = [r for r in result["rows"] if not r["ok"]]
    if wrong:
        w = wrong[0]
        raise WorkerFailure(f"{len(wrong)} result(s) were wrong, first: {w['collective']} {w['mode']}-of-place "
                            f"{w['size']} B on {w['link']} (max error {w['max_err']:g})",
                            fix="a wrong collective result is a broken transport or library; "
                                "rerun with NCCL_DEBUG=INFO and check `tandem doctor`")


def train_cmd(
    config: Optional[str] = typer.Argument(None, help="Job spec (toml/yaml); default: a small built-in "
                                                      "ResNet-18 on the digits set."),
    workers: str = typer.Option("1,2", "--workers", help="Worker counts to run, comma separated."),
    steps: int = typer.Option(30, "--steps", help="Optimizer steps per run (the first fifth is warm-up)."),
    micro_batch: int = typer.Option(0, "--micro-batch", help="Per-worker batch (0: the spec's)."),
    precision: str = typer.Option("", "--precision", help="fp32 | bf16 (default: the spec's)."),
    calibration: Optional[Path] = typer.Option(None, "--calibration",
                                               help="Calibration for the planner (default: RUN_DIR/calibration.json, "
                                                    "measured first with a quick `bench comm` if absent)."),
    run_dir: Path = typer.Option(Path("runs/bench-train"), "--run-dir", help="One folder per worker count."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the rows as JSON."),
) -> None:
    """Step time, throughput, speedup and efficiency at 1..N workers, next to `tandem plan`'s prediction.

    Example: tandem bench train --workers 1,2 --steps 30
    """
    from tandem.bench import train as tb

    try:
        counts = [int(w) for w in workers.split(",") if w.strip()]
    except ValueError:
        raise ConfigError("not a list of integers", field="--workers", value=workers, fix="e.g. --workers 1,2") from None
    opts = tb.TrainBenchOptions(workers=counts, steps=steps, micro_batch=micro_batch, config=config or "",
                                precision=precision).validate()
    out = Console(width=None if sys.stdout.isatty() else 150)
    cal = calibration or run_dir / "calibration.json"
    if not cal.is_file():
        if calibration is not None:
            raise ConfigError("no such calibration file", field="--calibration", value=str(cal),
                              fix="run `tandem bench comm --calibration FILE` first, or omit --calibration")
        out.print(f"no calibration at {cal}: measuring all_reduce on {max(counts)} workers first")
        quick = CommOptions(collectives=["all_reduce"], min_bytes=1 << 10, max_bytes=16 << 20, factor=4,
                            warmup=2, iters=10, mode="in").validate()  # DDP reduces its buckets in place
        res = measure(quick, LaunchSpec(nproc_per_node=comm_workers(counts)), run_dir / "comm")
        fit.write_calibration(cal, res)
    res = tb.run(opts, run_dir, cal, Console(stderr=True))
    out.print(tb.table(res))
    if res["model"]:
        mdl = res["model"]
        out.print(f"model on 1 worker: {mdl['achieved_flops'] / 1e9:.2f} GFLOP/s achieved ({mdl['name']}, "
                  f"{mdl['precision']}, {mdl['threads_per_worker']} thread(s), {mdl['background_threads']:.1f} "
                  f"other runnable threads on {mdl['cores']} cores), written to {cal} (compute.model); "
                  f"the other rows are predicted from it", highlight=False)
    which = "predicted rows" if res["error_rows"] == "predicted" else "all rows (no 1-worker calibration row)"
    out.print(f"planner error over {which}: median |predicted/measured - 1| = "
              f"{res['median_abs_pred_error'] * 100:.0f}%", highlight=False)
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(res, indent=1))


def typer_arg(help: str):
    return typer.Argument(..., help=help)


def typer_opt(default, flag: str, help: str):
    return typer.Option(default, flag, help=help)


def serve_cmd(
    url: str = typer_arg("URL of a running `tandem serve`, e.g. http://127.0.0.1:8000 (with --vs-batch-1: an "
                         "export folder)"),
    rate: float = typer_opt(50.0, "--rate", "Requests per second, sent on schedule (open loop)."),
    duration: float = typer_opt(10.0, "--duration", "Seconds of load."),
    kill_replica_at: Optional[float] = typer_opt(None, "--kill-replica-at",
                                                 "SIGKILL one replica this many seconds in (same machine: its pid "
                                                 "comes from the server's run dir, --server-run-dir)."),
    server_run_dir: Path = typer_opt(Path("runs/serve"), "--server-run-dir", "--kill-replica-at: the server's "
                                     "--run-dir (its replicas.json)."),
    max_new_tokens: int = typer_opt(8, "--max-new-tokens", "Tokens per /v1/generate request (gpt exports)."),
    json_out: Optional[Path] = typer_opt(None, "--json", "Write the results as JSON."),
    api_key_file: Optional[Path] = typer_opt(None, "--api-key-file", "Send the first key of this file (the "
                                                                     "server's --api-key-file) as a Bearer token."),
    vs_batch_1: bool = typer_opt(False, "--vs-batch-1", "Start two servers of the export URL names (--max-batch "
                                                        "32 and 1), step the rate up on both and print the "
                                                        "capacity ratio at the same p99 bound."),
    p99_ms: float = typer_opt(1000.0, "--p99-ms", "--vs-batch-1: the p99 a sustained rate stays within."),
    start_rate: float = typer_opt(5.0, "--start-rate", "--vs-batch-1: the first rate (then x1.5 a step)."),
    vs_static: bool = typer_opt(False, "--vs-static", "Like --vs-batch-1, but continuous against static batching "
                                                      "(same --max-batch 32) under a mixed load: every 4th "
                                                      "request --max-new-tokens long, the others 2 tokens."),
    plot: Optional[Path] = typer_opt(None, "--plot", "Write a PNG of latency over intended send time, errors "
                                                     "and the replica kill marked (needs the `plot` extra)."),
    openai: bool = typer_opt(False, "--openai", "Load /v1/completions instead (a non-stream run, then a stream "
                                                "run): time to first token, inter-token latency p50/p99, "
                                                "output tokens/s (--max-new-tokens each)."),
) -> None:
    """Open-loop constant-rate load: throughput, p50/p90/p99/max from each request's due time, codes.

    Example: tandem bench serve http://127.0.0.1:8000 --rate 100 --duration 10 --kill-replica-at 5
    """
    require("serve", "tandem bench serve")  # its client (httpx) and, with --vs-batch-1, the servers it starts
    if rate <= 0 or duration <= 0:
        raise ConfigError("must be positive", field="--rate" if rate <= 0 else "--duration",
                          value=rate if rate <= 0 else duration, fix="give a positive number")
    if kill_replica_at is not None and not 0 <= kill_replica_at < duration:
        raise ConfigError(f"must be within the run (0..{duration:g} s)", field="--kill-replica-at",
                          value=kill_replica_at, fix="give a time inside --duration")
    if openai and (kill_replica_at is not None or plot is not None or vs_batch_1 or vs_static):
        raise ConfigError("--openai measures token timing only", field="--openai", value=True,
                          fix="leave out --kill-replica-at, --plot, --vs-batch-1 and --vs-static with --openai")
    if plot is not None:
        from tandem.bench.serve_plot import check_path, require_matplotlib

        check_path(plot)
        require_matplotlib(plot)
    if vs_batch_1 or vs_static:
        return _vs_batch_1(Path(url), duration, p99_ms, start_rate, max_new_tokens, json_out, vs_static)
    import httpx

    try:
        key = None
        if api_key_file is not None:
            from tandem.serve.auth import first_key
            key = first_key(api_key_file)
        if openai:
            from tandem.bench.serve import bench_openai, print_openai_report

            both = bench_openai(url, rate, duration, max_new_tokens, key)
            for r in both.values():
                print_openai_report(r)
            if json_out:
                json_out.parent.mkdir(parents=True, exist_ok=True)
                json_out.write_text(json.dumps(both, indent=1) + "\n")
            return
        if kill_replica_at is not None and not (server_run_dir / "replicas.json").is_file():
            raise ConfigError("holds no replicas.json", field="--server-run-dir", value=str(server_run_dir),
                              fix="give the --run-dir of the `tandem serve` to kill a replica of")
        res = bench_serve(url, rate, duration, kill_replica_at, max_new_tokens, key, run_dir=server_run_dir)
    except httpx.ConnectError as e:
        raise ConfigError(f"no server answers ({e})", field="URL", value=url,
                          fix="start one with `tandem serve EXPORT_DIR` and give its URL") from None
    print_load_report(res)
    if plot is not None:
        from tandem.bench.serve_plot import plot_latency

        plot_latency(res, plot)
        print(f"  plot: {plot}")
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(res, indent=1) + "\n")


def _vs_batch_1(export: Path, duration: float, p99_ms: float, start_rate: float, max_new_tokens: int,
                json_out: Path | None, vs_static: bool = False) -> None:
    from tandem.bench import serve_batching as sb

    if not (export / "config.json").is_file():
        raise ConfigError("--vs-batch-1 takes an export folder (no config.json here)", field="URL",
                          value=str(export), fix="give a folder written by `tandem export`")
    what = "continuous vs static batching (mixed lengths)" if vs_static else "dynamic batching vs --max-batch 1"
    print(f"{what} on {export}: open loop, {duration:g} s per rate, both servers on this machine, alternating",
          flush=True)
    res = sb.compare(export, duration=duration, p99_ms=p99_ms, start_rate=start_rate, max_new_tokens=max_new_tokens,
                     say=lambda m: print(m, flush=True), sides=sb.STATIC if vs_static else None, mixed=vs_static)
    sb.print_summary(res)
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(res, indent=1) + "\n")


bench_app.command("comm")(comm_cmd)
bench_app.command("train")(train_cmd)
bench_app.command("serve")(serve_cmd)
