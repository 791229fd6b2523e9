"""`tandem submit --on ssh`: the flags to an SshJob, every check, then the dry run or the run (ssh.py, ssh_run.py)."""

from __future__ import annotations

import os
from pathlib import Path

from tandem.core.errors import ConfigError


def submit_ssh(*, run_dir: Path, command: list[str], train: bool, hostfile: Path | None, env: list[str],
               nodes: int, nproc_per_node: int, ssh_config: str, master_port: int, watchdog_s: float,
               dry_run: bool) -> int:
    """Exit code: 0 when every host's agent exited 0 (or on a dry run)."""
    from tandem.launch.ssh import SshJob, parse_hostfile, prepare, render

    if hostfile is None:
        raise ConfigError("--on ssh needs a hostfile", field="--hostfile", fix="pass --hostfile FILE with one "
                          "`HOST slots=N` line per machine")
    job = SshJob(run_dir=run_dir, command=command, hosts=parse_hostfile(hostfile), train=train, nodes=nodes,
                 nproc_per_node=nproc_per_node, env_keys=list(env), ssh_config=str(Path(ssh_config).resolve()) if ssh_config else "", master_port=master_port,
                 watchdog_s=watchdog_s)
    plan = prepare(job, dict(os.environ), dry_run=dry_run)
    if dry_run:
        print(render(plan), end="")
        return 0
    from tandem.launch.ssh_run import run_job

    print(f"submitted: ssh job, world {plan.world} on {len(plan.nodes)} host(s) "
          f"({', '.join(f'{h.name} x{k}' for h, k in plan.nodes)}), master {plan.master_addr}:{master_port}; "
          f"follow it: tandem status {run_dir}", flush=True)
    return run_job(plan)
