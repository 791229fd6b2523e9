"""`tandem submit --on ssh`: the flags to an SshJob, every check, then the dry run or the run.

The plan (hosts, placement, each host's ssh command) is ssh_plan.py's; running it, and the
status and cancel of a run from its record, ssh_run.py's. The job runs in the foreground:
`tandem submit` is the driver, and its exit code is the job's.
"""

from __future__ import annotations

import os
from pathlib import Path

from rich.console import Console

from tandem.core.errors import ConfigError
from tandem.submit.backend import Status, SubmitFlags, Submitted
from tandem.submit.ssh_plan import Plan, SshJob, parse_hostfile, prepare, render
from tandem.submit.ssh_run import run_job, ssh_cancel, ssh_status


class SshBackend:
    """`--on ssh`: one `tandem launch` (or `tandem train`) agent per hostfile line, each over its own ssh."""

    name = "ssh"

    def options(self, flags: SubmitFlags) -> SshJob:
        if flags.hostfile is None:
            raise ConfigError("--on ssh needs a hostfile", field="--hostfile", fix="pass --hostfile FILE with one "
                              "`HOST slots=N` line per machine")
        return SshJob(run_dir=flags.run_dir, command=flags.command, hosts=parse_hostfile(flags.hostfile),
                      train=flags.train, nodes=flags.nodes if flags.nodes_given else 0,
                      nproc_per_node=flags.nproc_per_node if flags.nproc_given else 0, env_keys=list(flags.env),
                      ssh_config=str(Path(flags.ssh_config).resolve()) if flags.ssh_config else "",
                      master_port=flags.master_port, watchdog_s=flags.watchdog_s)

    def plan(self, options: SshJob, *, dry_run: bool) -> Plan:
        return prepare(options, dict(os.environ), dry_run=dry_run)

    def dry_run(self, options: SshJob) -> str:
        return render(self.plan(options, dry_run=True))

    def submit(self, options: SshJob, console: Console) -> Submitted:
        """Blocks while the job runs; the hosts' lines stream meanwhile. Exit code 0 when every host's agent
        exited 0."""
        plan = self.plan(options, dry_run=False)
        print(f"submitted: ssh job, world {plan.world} on {len(plan.nodes)} host(s) "
              f"({', '.join(f'{h.name} x{k}' for h, k in plan.nodes)}), master {plan.master_addr}:"
              f"{options.master_port}; follow it: tandem status {options.run_dir}", flush=True)
        return Submitted(exit_code=run_job(plan))

    def status(self, run_dir: Path) -> Status:
        state, line = ssh_status(run_dir)
        return Status(state, line, ended_badly=state in ("FAILED", "CANCELLED", "LOST"))

    def cancel(self, run_dir: Path) -> str:
        where = ", ".join(ssh_cancel(run_dir)) or "no host (none was running)"
        return f"cancelled: ssh job: SIGTERM to the agents on {where}"

    def logs(self, run_dir: Path) -> str | None:
        return None  # the agents' own lines went to `tandem submit`'s terminal; the ranks' are the run dir's
