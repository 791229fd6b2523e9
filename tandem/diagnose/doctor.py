"""`tandem doctor`'s checks from the parent's side: this machine's own, an NCCL log's, and the workers'
(doctor_worker.py) gathered from every node through the launcher."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Optional

from rich.console import Console

from tandem.bench.runner import procs_on_this_host, read_result, run_module
from tandem.core.errors import ConfigError, LaunchError, TandemError, WorkerFailure
from tandem.core.spec import LaunchSpec
from tandem.diagnose import nccl_log, network, system
from tandem.diagnose.checks import FAIL, Check
from tandem.diagnose.options import DoctorOptions


def expected_busbw(expect: float, calibration: Optional[Path], nnodes_max: int) -> float:
    if expect > 0 or calibration is None:
        return expect
    try:
        cal = json.loads(calibration.read_text())
        link = cal["links"]["inter_node" if nnodes_max > 1 and "inter_node" in cal["links"] else "intra_node"]
        return float(link["bandwidth_Bps"]) / 1e9
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"cannot read a bandwidth from the calibration ({type(e).__name__}: {e})",
                          field="--calibration", value=str(calibration),
                          fix="give a file written by `tandem bench comm` (schema tandem.calibration/1)") from None


def local_checks(opts: DoctorOptions, wl: LaunchSpec) -> list[Check]:
    """What this machine can tell alone, before (or without) starting any worker."""
    return [*system.node_checks(opts.device, opts.nproc_per_node, opts.checkpoint_path),
            *network.network_checks(dict(os.environ), wl.master_addr if not wl.rdzv_endpoint
                                    else wl.rdzv_endpoint.rsplit(":", 1)[0],
                                    wl.master_port if not wl.rdzv_endpoint
                                    else int(wl.rdzv_endpoint.rsplit(":", 1)[1]))]


def nccl_log_checks(path: Path) -> tuple[list[Check], dict]:
    """`tandem doctor --nccl-log`: the log's findings as checks, and its summary for the JSON."""
    s = nccl_log.read(path)
    local_ib = network.rdma().devices
    checks = nccl_log.judge(s, local_ib if s.hosts and os.uname().nodename in s.hosts else None)
    extra = {"nccl_log": {**{k: v for k, v in dataclasses.asdict(s).items() if k not in ("peers", "transports")},
                          "transports": dict(s.transports),
                          "peers": {f"{a}->{b}": t for (a, b), t in sorted(s.peers.items())}}}
    return checks, extra


def run_workers(opts: DoctorOptions, wl: LaunchSpec, run_dir: Path) -> list[Check] | Check | None:
    """Checks gathered from every node, None on a node without rank 0, or a fail row if they could not run."""
    run_dir.mkdir(parents=True, exist_ok=True)
    opts_path, res_path = run_dir / "doctor-options.json", run_dir / "doctor.json"
    opts_path.write_text(json.dumps(dataclasses.asdict(opts)))
    res_path.unlink(missing_ok=True)
    try:
        with Console(stderr=True).status(f"checking {procs_on_this_host(wl)} local workers ..."):
            run_module(wl, "tandem.diagnose.doctor_worker",
                       ["--options", str(opts_path.resolve()), "--out", str(res_path.resolve())], run_dir)
        res = read_result(res_path, wl)
    except LaunchError as e:
        # The launcher's fix speaks of jobs; here a missing node is the finding itself.
        return Check("nodes joined", FAIL, e.message, node="all",
                     fix=f"start `tandem doctor` with the same --nnodes/--master-addr/--master-port on every "
                         f"node within --timeout {wl.timeout_s} s; a node that never joins is down or cannot "
                         f"reach the master (see 'route to master' on that node)")
    except WorkerFailure as e:
        return Check("workers", FAIL, e.message.splitlines()[0][:300], node="all",
                     fix=f"see the per-rank logs in {run_dir / 'logs'}")
    except TandemError:
        raise
    if res is None:
        return None
    return [Check.from_dict(d) for d in res["checks"]]
