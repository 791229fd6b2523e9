"""`tandem submit --on slurm|k8s|ssh|ray`, `tandem status RUN_DIR`, `tandem cancel RUN_DIR`.

tandem writes the job for the engine the user already runs and hands it over; the engine
places, signals and restarts it. What was submitted is recorded in RUN_DIR/submit/. Ray is the
exception in form: this process is Ray's driver and stays in the foreground (ray_job.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from tandem.core import rundir
from tandem.core.console import make_console
from tandem.core.errors import ConfigError

ENGINES = ("slurm", "k8s", "ssh", "ray")
SPEC_SUFFIXES = (".toml", ".yaml", ".yml")


def submit_cmd(
    ctx: typer.Context,
    target: str = typer.Argument(..., help="A Python script (run by `tandem launch` on every node) or a job spec "
                                           "(.toml/.yaml, run by `tandem train`); what follows goes to it."),
    on: str = typer.Option(..., "--on", help="slurm | k8s | ssh | ray."),
    nodes: int = typer.Option(1, "--nodes", help="Nodes (machines)."),
    nproc_per_node: int = typer.Option(1, "--nproc-per-node", help="Workers per node."),
    run_dir: Path = typer.Option(Path("runs/submit"), "--run-dir", help="Logs, checkpoints and submit/ go here "
                                                                         "(on storage every node sees)."),
    partition: str = typer.Option("", "--partition", help="Slurm partition (default: the cluster's)."),
    time: str = typer.Option("", "--time", help="Slurm time limit: minutes, H:MM:SS or D-HH."),
    job_name: str = typer.Option("tandem", "--job-name", help="Job name in the queue."),
    max_requeues: int = typer.Option(0, "--max-requeues", help="Requeue after a save-and-exit on SIGTERM "
                                                               "(preemption) up to this many times."),
    signal_s: int = typer.Option(0, "--signal-s", help="Ask for SIGTERM this many seconds before the time limit."),
    cpus_per_task: int = typer.Option(0, "--cpus-per-task", help="CPUs per node's task (0: the cluster's default)."),
    gpus_per_node: int = typer.Option(0, "--gpus-per-node", help="GPUs per node (Slurm --gpus-per-node; k8s "
                                                                 "nvidia.com/gpu)."),
    sbatch_arg: list[str] = typer.Option([], "--sbatch-arg", help="Extra #SBATCH line, e.g. --sbatch-arg=--qos=low "
                                                                  "(repeatable)."),
    image: str = typer.Option("", "--image", help="k8s: container image with tandem and your code."),
    kind: str = typer.Option("jobset", "--kind", help="k8s: jobset | pytorchjob | indexed (Job + headless "
                                                      "Service)."),
    namespace: str = typer.Option("default", "--namespace", help="k8s: namespace."),
    queue: str = typer.Option("", "--queue", help="k8s: Kueue queue name (label kueue.x-k8s.io/queue-name)."),
    hostfile: Path = typer.Option(None, "--hostfile", help="ssh: `HOST slots=N` per line; node rank = line order."),
    env: list[str] = typer.Option([], "--env", help="ssh: also pass this variable on (NAME or NAME=VALUE; "
                                                    "repeatable). TANDEM_*, NCCL_*, GLOO_*, PYTHONPATH always go."),
    ssh_config: str = typer.Option("", "--ssh-config", help="ssh: an ssh_config file (ssh -F)."),
    master_port: int = typer.Option(29500, "--master-port", help="ssh: rendezvous port on the first host."),
    watchdog_s: float = typer.Option(0, "--watchdog-s", help="ssh: each agent's hang watchdog (tandem launch)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the script / manifest / ssh commands; submit "
                                                          "nothing."),
    address: str = typer.Option("", "--address", help="ray: the cluster's GCS address HOST:PORT (`ray start "
                                                      "--head` prints it); none: a local Ray for this job."),
    workers: int = typer.Option(0, "--workers", help="ray: training workers (0: --nodes x --nproc-per-node)."),
    max_failures: int = typer.Option(0, "--max-failures", help="ray: restarts of the worker group after a "
                                                               "failure (each resumes from the run dir's latest)."),
) -> None:
    """Hand a job to the cluster you already run: an sbatch script (Slurm), a manifest (Kubernetes), or
    Ray Train's workers (Ray: this process is the driver, in the foreground).

    Example: tandem submit --on slurm --nodes 2 --nproc-per-node 2 examples/hello_dist.py
    Example: tandem submit --on ssh --hostfile hosts.txt examples/hello_dist.py
    Example: tandem submit --on ray --address HEAD:6379 --workers 4 --max-failures 2 job.toml
    """
    console = make_console()
    if on not in ENGINES:
        raise ConfigError(f"{on!r} is not one of {', '.join(ENGINES)}", field="--on", value=on,
                          fix="use --on slurm, --on k8s, --on ssh or --on ray")
    command = [target, *ctx.args]
    train = target.endswith(SPEC_SUFFIXES)
    if on == "ssh":
        from tandem.launch.ssh_cli import submit_ssh

        given = {n: ctx.get_parameter_source(n).name != "DEFAULT" for n in ("nodes", "nproc_per_node")}
        sys.exit(submit_ssh(run_dir=run_dir, command=command, train=train, hostfile=hostfile, env=env,
                            nodes=nodes if given["nodes"] else 0,
                            nproc_per_node=nproc_per_node if given["nproc_per_node"] else 0,
                            ssh_config=ssh_config, master_port=master_port, watchdog_s=watchdog_s, dry_run=dry_run))
    if on == "ray":
        _submit_ray(target, list(ctx.args), run_dir, workers or nodes * nproc_per_node, max_failures, address,
                    console)
        return
    if on == "slurm":
        from tandem.launch.slurm import SlurmJob, submit

        job = SlurmJob(run_dir=run_dir, command=command, train=train, nodes=nodes, nproc_per_node=nproc_per_node,
                       partition=partition, time=time, job_name=job_name, max_requeues=max_requeues,
                       signal_s=signal_s, cpus_per_task=cpus_per_task, gpus_per_node=gpus_per_node,
                       sbatch_args=[a if a.startswith("--") else f"--{a}" for a in sbatch_arg])
        job_id, text = submit(job, dry_run=dry_run)
        if dry_run:
            print(text, end="")
            return
        console.print(f"submitted: slurm job {job_id} ({nodes} node(s) x {nproc_per_node} worker(s)); script "
                      f"{run_dir / 'submit' / 'job.sbatch'}; output {run_dir / 'submit'}/slurm-{job_id}.out",
                      highlight=False, soft_wrap=True)
        console.print(f"  follow it: tandem status {run_dir}", highlight=False)
        return
    from tandem.launch.k8s import K8sJob, submit_k8s

    job = K8sJob(run_dir=run_dir, command=command, train=train, nodes=nodes, nproc_per_node=nproc_per_node,
                 name=job_name, image=image, kind=kind, namespace=namespace, queue=queue,
                 gpus_per_node=gpus_per_node, cpus_per_node=cpus_per_task, max_restarts=max_requeues)
    text = submit_k8s(job, dry_run=dry_run)
    if dry_run:
        print(text, end="")
        return
    console.print(f"applied: {kind} {job_name} in namespace {namespace}; manifest {run_dir / 'submit' / 'job.yaml'}",
                  highlight=False, soft_wrap=True)


def _submit_ray(target: str, overrides: list[str], run_dir: Path, workers: int, max_failures: int, address: str,
                console) -> None:
    if not target.endswith(SPEC_SUFFIXES):
        raise ConfigError("Ray runs a job spec (the trainer is Ray Train's training function)", field="--on",
                          value=target, fix="give a .toml/.yaml job spec, or use --on slurm|k8s for a script")
    from tandem.launch.ray_job import submit_ray

    r = submit_ray(target, overrides, run_dir, workers=workers, max_failures=max_failures, address=address,
                   console=console)
    restarts = r.get("restarts") or []
    redone = sum(x.get("steps_redone", 0) for x in restarts)
    last = next((m for m in reversed(rundir.read_metrics(run_dir)) if m.get("kind") == "step"), {})
    acc = f"{r['accuracy']:.4f}" if r.get("accuracy") is not None else "not measured"
    console.print(f"[green]done[/]: {r['step']} steps on {r['world']} Ray workers, last loss "
                  f"{last.get('loss', 0):.4f}, "
                  f"held-out accuracy {acc}, {len(restarts)} restart(s) ({redone} step(s) redone)\n"
                  f"  checkpoint: {r.get('checkpoint')}\n  logs: {run_dir.resolve() / 'logs'}/rank-*.log",
                  highlight=False, soft_wrap=True)


def status_cmd(run_dir: Path = typer.Argument(..., help="The --run-dir of a `tandem submit`.")) -> None:
    """Where a submitted job is: queued, running, requeued N times, done, or failed and why.

    Example: tandem status runs/submit
    """
    from tandem.launch.slurm import read_record, slurm_status

    rec = read_record(run_dir)
    if rec.get("engine") == "ssh":
        from tandem.launch.ssh_run import ssh_status

        state, line = ssh_status(run_dir)
        make_console().print(line, highlight=False, soft_wrap=True, markup=False)
        sys.exit(1 if state in ("FAILED", "CANCELLED", "LOST") else 0)
    if rec.get("engine") == "ray":
        from tandem.launch.ray_job import ray_status

        state, line = ray_status(run_dir)
        make_console().print(line, highlight=False, soft_wrap=True, markup=False)  # reasons hold [file:line]
        sys.exit(1 if state in ("FAILED", "CANCELLED") else 0)
    if rec.get("engine") != "slurm":
        raise ConfigError(f"status of {rec.get('engine')} jobs is not implemented", field="run_dir",
                          value=str(run_dir), fix="ask the engine (kubectl get jobset / kubectl logs)")
    state, line = slurm_status(run_dir)
    make_console().print(line, highlight=False, soft_wrap=True, markup=False)
    if state in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"):
        sys.exit(1)  # a job that ended badly: scripts can test `tandem status` like the job itself


def cancel_cmd(run_dir: Path = typer.Argument(..., help="The --run-dir of a `tandem submit`.")) -> None:
    """Cancel a submitted job (scancel; over ssh: SIGTERM to every host's agent).

    Example: tandem cancel runs/submit
    """
    from tandem.launch.slurm import read_record

    if read_record(run_dir).get("engine") == "ssh":
        from tandem.launch.ssh_run import ssh_cancel

        told = ssh_cancel(run_dir)
        where = ", ".join(told) or "no host (none was running)"
        make_console().print(f"cancelled: ssh job: SIGTERM to the agents on {where}",
                             highlight=False, soft_wrap=True)
        return
    from tandem.launch.slurm import slurm_cancel

    engine = read_record(run_dir).get("engine")
    if engine != "slurm":
        raise ConfigError(f"cancel of {engine} jobs is not implemented", field="run_dir", value=str(run_dir),
                          fix="ray: Ctrl-C the `tandem submit` driver (Ray stops the workers); k8s: kubectl delete")
    job_id = slurm_cancel(run_dir)
    make_console().print(f"cancelled: slurm job {job_id}", highlight=False)
