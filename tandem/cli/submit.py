"""`tandem submit --on slurm|k8s|ssh|ray`, `tandem status RUN_DIR`, `tandem cancel RUN_DIR`.

tandem writes the job for the engine the user already runs and hands it over; the engine
places, signals and restarts it. What was submitted is recorded in RUN_DIR/submit/. The engines
are tandem/submit/'s, one interface each (submit/backend.py); these verbs parse, ask the engine
named by --on (or by the run dir's record) and print its answer. ssh and Ray run in the
foreground: this process drives the job, and its exit code is the job's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from tandem.cli.passthrough import refuse_unknown_option
from tandem.core.console import make_console


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
    cpus_per_task: int = typer.Option(0, "--cpus-per-task", help="CPUs per node's task (Slurm: 0, the cluster's "
                                                                 "default; k8s: the pod's CPU request, 0: 2 per "
                                                                 "worker)."),
    gpus_per_node: int = typer.Option(0, "--gpus-per-node", help="GPUs per node (Slurm --gpus-per-node; k8s "
                                                                 "nvidia.com/gpu)."),
    sbatch_arg: list[str] = typer.Option([], "--sbatch-arg", help="Extra #SBATCH line, e.g. --sbatch-arg=--qos=low "
                                                                  "(repeatable)."),
    image: str = typer.Option("", "--image", help="k8s: container image with tandem and your code."),
    kind: str = typer.Option("jobset", "--kind", help="k8s: jobset | trainjob (Kubeflow Trainer v2) | indexed "
                                                      "(Job + headless Service)."),
    namespace: str = typer.Option("default", "--namespace", help="k8s: namespace."),
    queue: str = typer.Option("", "--queue", help="k8s: Kueue queue name (label kueue.x-k8s.io/queue-name)."),
    pvc: str = typer.Option("", "--pvc", help="k8s: a ReadWriteMany PersistentVolumeClaim mounted at --run-dir "
                                              "(absolute), so checkpoints outlive a pod's restart."),
    volume: list[str] = typer.Option([], "--volume", help="k8s: CLAIM:PATH, a PersistentVolumeClaim mounted at "
                                                          "PATH (repeatable); a --run-dir under PATH is on it."),
    shm_size: str = typer.Option("8Gi", "--shm-size", help="k8s: /dev/shm, a memory-backed emptyDir of this size "
                                                           "(0: none; the runtime's default is 64 MB)."),
    memory: str = typer.Option("", "--memory", help="k8s: the pod's memory request, e.g. 64Gi (default: 8Gi per "
                                                    "worker)."),
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
    refuse_unknown_option(ctx, target, "submit")
    # deferred: the engines' modules load only when a job is submitted (`tandem --help` stays fast)
    from tandem.submit.backend import SubmitFlags
    from tandem.submit.registry import backend_named

    backend = backend_named(on)
    given = {n: ctx.get_parameter_source(n).name != "DEFAULT" for n in ("nodes", "nproc_per_node")}
    flags = SubmitFlags(target=target, args=tuple(ctx.args), run_dir=run_dir, nodes=nodes,
                        nproc_per_node=nproc_per_node, nodes_given=given["nodes"],
                        nproc_given=given["nproc_per_node"], job_name=job_name, max_requeues=max_requeues,
                        cpus_per_task=cpus_per_task, gpus_per_node=gpus_per_node, partition=partition, time=time,
                        signal_s=signal_s, sbatch_args=tuple(sbatch_arg), image=image, kind=kind,
                        namespace=namespace, queue=queue, pvc=pvc, volumes=tuple(volume), shm_size=shm_size,
                        memory=memory, hostfile=hostfile, env=tuple(env), ssh_config=ssh_config,
                        master_port=master_port, watchdog_s=watchdog_s, address=address, workers=workers,
                        max_failures=max_failures)
    options = backend.options(flags)
    if dry_run:
        print(backend.dry_run(options), end="")
        return
    console = make_console()
    done = backend.submit(options, console)
    for line in done.lines:
        console.print(line, highlight=False, soft_wrap=True)
    if done.exit_code:
        sys.exit(done.exit_code)


def status_cmd(run_dir: Path = typer.Argument(..., help="The --run-dir of a `tandem submit`.")) -> None:
    """Where a submitted job is: queued, running, requeued N times, done, or failed and why.

    Example: tandem status runs/submit
    """
    from tandem.submit.registry import backend_of  # deferred, as in submit_cmd

    status = backend_of(run_dir, "status").status(run_dir)
    make_console().print(status.line, highlight=False, soft_wrap=True, markup=False)  # reasons hold [file:line]
    if status.ended_badly:
        sys.exit(1)  # a job that ended badly: scripts can test `tandem status` like the job itself


def cancel_cmd(run_dir: Path = typer.Argument(..., help="The --run-dir of a `tandem submit`.")) -> None:
    """Cancel a submitted job (scancel; over ssh: SIGTERM to every host's agent).

    Example: tandem cancel runs/submit
    """
    from tandem.submit.registry import backend_of  # deferred, as in submit_cmd

    make_console().print(backend_of(run_dir, "cancel").cancel(run_dir), highlight=False, soft_wrap=True)
