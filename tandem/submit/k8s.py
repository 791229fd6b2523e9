"""`tandem submit --on k8s`: apply the manifest (k8s_manifests.py) with kubectl; status from the cluster.

    K8sBackend().submit(job, console)   # RUN_DIR/submit/job.yaml, `kubectl apply -f` it, job.json
    K8sBackend().status(run_dir)        # `kubectl get KIND NAME -o json`, read by k8s_state()

Status asks the cluster the job went to (kubectl's current context): the top-level object's
conditions (Failed, Complete(d), Suspended: waiting for Kueue's admission) and its counts
(JobSet and TrainJob count their Jobs, an indexed Job its pods). Where kubectl is missing or the
cluster does not answer, `tandem status` says so in one line instead of guessing. Cancel stays
kubectl's (`kubectl delete -f RUN_DIR/submit/job.yaml`).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from rich.console import Console

from tandem.core.errors import ConfigError, LaunchError
from tandem.submit.backend import Status, SubmitFlags, Submitted
from tandem.submit.k8s_manifests import K8sJob, render
from tandem.submit.record import read_record, write_record

# what `kubectl get` calls the top-level object of each --kind (an indexed job's Service has no state)
RESOURCES = {"jobset": "jobsets.jobset.x-k8s.io", "trainjob": "trainjobs.trainer.kubeflow.org",
             "indexed": "jobs.batch"}
COUNTS = ("active", "ready", "succeeded", "failed")


def apply(job: K8sJob) -> str:
    """The manifest text, written to RUN_DIR/submit/job.yaml and applied with kubectl."""
    text = render(job)
    kubectl = shutil.which("kubectl")
    if not kubectl:
        raise LaunchError("kubectl is not on PATH", field="--on", value="k8s",
                          fix="install kubectl and point it at your cluster, or use --dry-run to see the manifest")
    sub = job.run_dir / "submit"
    sub.mkdir(parents=True, exist_ok=True)
    (sub / "job.yaml").write_text(text)
    r = subprocess.run([kubectl, "apply", "-f", str(sub / "job.yaml")], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise LaunchError(f"kubectl apply failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}", field="--on",
                          value="k8s", fix=f"fix what kubectl says; the manifest is {sub / 'job.yaml'}")
    write_record(job.run_dir, {"engine": "k8s", "kind": job.kind, "name": job.name, "namespace": job.namespace})
    return text


def ask_cluster(rec: dict, run_dir: Path) -> dict:
    """`kubectl get` of the job's top-level object, as JSON; one line when nobody can answer."""
    kind, name, ns = rec.get("kind", "jobset"), rec.get("name", "?"), rec.get("namespace", "default")
    by_hand = f"kubectl get {RESOURCES.get(kind, kind)} {name} -n {ns}"
    kubectl = shutil.which("kubectl")
    if not kubectl:
        raise LaunchError(f"k8s {kind} {name}: status unknown: kubectl is not on PATH, so no cluster can be asked",
                          field="run_dir", value=str(run_dir),
                          fix=f"install kubectl with the context of the cluster the job went to, then `{by_hand}`")
    try:
        r = subprocess.run([kubectl, "get", RESOURCES.get(kind, kind), name, "-n", ns, "-o", "json"],
                           capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        r = subprocess.CompletedProcess([], 1, "", "no answer in 60 s")
    if r.returncode != 0:
        why = (r.stderr.strip().splitlines() or [f"kubectl exited {r.returncode}"])[-1]
        raise LaunchError(f"k8s {kind} {name}: status unknown: the cluster did not answer: {why}",
                          field="run_dir", value=str(run_dir),
                          fix=f"point kubectl at the cluster the job went to (kubectl config use-context), then "
                              f"`{by_hand}`")
    try:
        return json.loads(r.stdout)
    except ValueError:
        raise LaunchError(f"k8s {kind} {name}: status unknown: kubectl's answer is not JSON", field="run_dir",
                          value=str(run_dir), fix=f"run `{by_hand} -o json` and see what it says") from None


def k8s_state(obj: dict) -> tuple[str, str]:
    """(state, the details) from a JobSet, TrainJob or Job as `kubectl get -o json` gives it."""
    status = obj.get("status") or {}
    true = {c.get("type"): c for c in status.get("conditions") or [] if str(c.get("status")) == "True"}
    if obj.get("kind") == "Job":
        counts, unit = {k: int(status.get(k) or 0) for k in COUNTS}, "pods"
        restarts = counts["failed"]                         # backoffLimit: failed pods retried one by one
    else:
        groups = status.get("replicatedJobsStatus") or status.get("jobsStatus") or []
        counts, unit = {k: sum(int(g.get(k) or 0) for g in groups) for k in COUNTS}, "jobs"
        restarts = int(status.get("restarts") or 0)         # JobSet's failurePolicy: the whole group again
    if "Failed" in true:
        c = true["Failed"]
        state, why = "FAILED", ": ".join(x for x in (c.get("reason"), c.get("message")) if x)
    elif "Completed" in true or "Complete" in true:
        state, why = "COMPLETED", ""
    elif "Suspended" in true:
        state, why = "SUSPENDED", "waiting to be admitted (Kueue) or suspended by hand"
    else:
        state, why = ("RUNNING" if counts["active"] else "PENDING"), ""
    parts = [f"{unit} " + ", ".join(f"{k} {counts[k]}" for k in COUNTS), f"restarted {restarts} time(s)"]
    return state, "; ".join([*parts, *([why] if why else [])])


class K8sBackend:
    """`--on k8s`: a JobSet, a Kubeflow TrainJob or an indexed Job, applied with kubectl."""

    name = "k8s"

    def options(self, flags: SubmitFlags) -> K8sJob:
        return K8sJob(run_dir=flags.run_dir, command=flags.command, train=flags.train, nodes=flags.nodes,
                      nproc_per_node=flags.nproc_per_node, name=flags.job_name, image=flags.image, kind=flags.kind,
                      namespace=flags.namespace, queue=flags.queue, gpus_per_node=flags.gpus_per_node,
                      cpus_per_node=flags.cpus_per_task, max_restarts=flags.max_requeues, memory=flags.memory,
                      pvc=flags.pvc, volumes=flags.volumes, shm_size=flags.shm_size)

    def dry_run(self, options: K8sJob) -> str:
        return render(options)

    def submit(self, options: K8sJob, console: Console) -> Submitted:
        apply(options)
        return Submitted((f"applied: {options.kind} {options.name} in namespace {options.namespace}; manifest "
                          f"{options.run_dir / 'submit' / 'job.yaml'}",))

    def status(self, run_dir: Path) -> Status:
        rec = read_record(run_dir)
        state, details = k8s_state(ask_cluster(rec, run_dir))
        line = f"k8s {rec.get('kind')} {rec.get('name')} (namespace {rec.get('namespace')}): {state}; {details}"
        return Status(state, line, ended_badly=state == "FAILED")

    def cancel(self, run_dir: Path) -> str:
        raise ConfigError("cancel of k8s jobs is kubectl's (the cluster owns the objects)", field="run_dir",
                          value=str(run_dir), fix=f"kubectl delete -f {run_dir / 'submit' / 'job.yaml'}")

    def logs(self, run_dir: Path) -> str | None:
        rec = read_record(run_dir)
        return (f"k8s {rec.get('kind')} {rec.get('name')}: the pods' own output: kubectl logs -n "
                f"{rec.get('namespace')} -l tandem.dev/job={rec.get('name')} --prefix")
