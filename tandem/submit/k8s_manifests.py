"""`tandem submit --on k8s`'s manifests: objects that run `tandem launch` (or `tandem train`) once per node.

    text = render(K8sJob(run_dir=Path("runs/x"), command=["train.py"], nodes=2, nproc_per_node=4,
                         image="registry/me/train:1"))      # k8s.py applies it and asks for its status

Three kinds, one pod per node each, torchrun's static rendezvous on pod 0:

* ``jobset`` (default, jobset.x-k8s.io/v1alpha2): one replicated Job, indexed; JobSet gives
  every pod a stable DNS name (``NAME-node-0-0.NAME``) and restarts the whole group on a
  failure (``failurePolicy.maxRestarts``), which is what a rendezvous needs.
* ``trainjob`` (Kubeflow Trainer v2, trainer.kubeflow.org/v1alpha1) on the ``torch-distributed``
  runtime: the runtime sets PET_NNODES / PET_NODE_RANK / PET_MASTER_ADDR / PET_MASTER_PORT,
  which the command passes on.
* ``indexed``: a plain batch/v1 indexed Job and a headless Service (no operator needed); a
  failed pod is retried alone (``backoffLimit``), so a restart that needs the whole group is
  the JobSet's job.

The node rank comes from the Job's completion index; SIGTERM (pod deletion, preemption) reaches
tandem, which saves on the way out within ``terminationGracePeriodSeconds``. A restart resumes
only from a run dir that outlives the pod: ``--pvc CLAIM`` mounts a PersistentVolumeClaim at the
run dir (``--volume CLAIM:PATH`` at PATH, the run dir under it), and restarts (max_restarts > 0)
with the run dir on the container's own disk are refused. Every pod also gets a memory-backed
``/dev/shm`` (a container runtime's default is 64 MB, too small for DataLoader workers and NCCL)
and CPU / memory requests, so the scheduler places it where it fits. The TrainJob takes the
volumes through a runtime patch of the runtime's ``node`` job and container. Not run against a
real cluster here: the tests validate the manifests against Kubeflow's published models
(kubeflow-trainer-api).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from tandem.core.errors import ConfigError

KINDS = ("jobset", "trainjob", "indexed")
PORT = 29500
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
NAME = re.compile(r"^[a-z]([-a-z0-9]{0,38}[a-z0-9])?$")
CLAIM = re.compile(r"^[a-z0-9]([-.a-z0-9]{0,251}[a-z0-9])?$")      # a PVC's name: a DNS subdomain
QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")
CPUS_PER_WORKER, GI_PER_WORKER = 2, 8  # the requests when --cpus-per-task / --memory are not given
SHM_SIZE = "8Gi"
PATCH_MANAGER = "tandem.dev/submit"


@dataclass
class K8sJob:
    run_dir: Path
    command: list[str]
    train: bool = False
    nodes: int = 1
    nproc_per_node: int = 1
    name: str = "tandem"
    image: str = ""
    kind: str = "jobset"
    namespace: str = "default"
    queue: str = ""                 # Kueue LocalQueue
    gpus_per_node: int = 0
    cpus_per_node: int = 0
    memory: str = ""                # memory request per pod ("": GI_PER_WORKER Gi per worker)
    max_restarts: int = 0
    grace_s: int = 120              # time tandem gets to checkpoint after SIGTERM
    env: dict[str, str] = field(default_factory=dict)
    pvc: str = ""                   # a PersistentVolumeClaim mounted at the run dir
    volumes: tuple[str, ...] = ()   # CLAIM:PATH, more claims mounted at PATH (the run dir may be under one)
    shm_size: str = SHM_SIZE        # /dev/shm as a memory emptyDir of this size; "0": none


def mounts(job: K8sJob) -> list[tuple[str, str, str]]:
    """(volume name, claim, mount path) of every claim the pod mounts, the run dir's first."""
    out = [("run-dir", job.pvc, str(job.run_dir))] if job.pvc else []
    for i, v in enumerate(job.volumes):
        claim, _, path = v.partition(":")
        out.append((f"volume-{i}", claim, path))
    return out


def _on_a_volume(job: K8sJob) -> bool:
    run = PurePosixPath(str(job.run_dir))
    return any(run == PurePosixPath(p) or PurePosixPath(p) in run.parents for _, _, p in mounts(job))


def check(job: K8sJob) -> None:
    if job.kind not in KINDS:
        raise ConfigError(f"{job.kind!r} is not one of {', '.join(KINDS)}", field="--kind", value=job.kind,
                          fix="use --kind jobset (default), trainjob or indexed")
    if not NAME.match(job.name):
        raise ConfigError("not a valid Kubernetes name (lower-case letters, digits and '-', 40 at most, "
                          "starting with a letter)", field="--job-name", value=job.name, fix="use e.g. --job-name "
                          "resnet-2x4")
    if not job.image:
        raise ConfigError("a container image is needed", field="--image",
                          fix="give --image REGISTRY/IMAGE:TAG with tandem and your code in it")
    if job.nodes < 1 or job.nproc_per_node < 1:
        raise ConfigError("must be at least 1", field="--nodes" if job.nodes < 1 else "--nproc-per-node",
                          value=min(job.nodes, job.nproc_per_node), fix="use 1 or more")
    if not job.command:
        raise ConfigError("nothing to run", field="script", fix="give a Python script or a job spec (.toml/.yaml)")
    _check_volumes(job)
    for flag, q in (("--memory", job.memory), ("--shm-size", job.shm_size)):
        if q and not QUANTITY.match(q):
            raise ConfigError("not a Kubernetes quantity", field=flag, value=q, fix="use e.g. 64Gi or 512Mi")


def _check_volumes(job: K8sJob) -> None:
    if job.pvc and not job.run_dir.is_absolute():
        raise ConfigError("a volume mounts at an absolute path in the pod", field="--run-dir",
                          value=str(job.run_dir), fix=f"give --pvc {job.pvc} an absolute --run-dir, e.g. "
                          f"--run-dir /{job.run_dir}")
    for v in job.volumes:
        claim, sep, path = v.partition(":")
        if not sep or not CLAIM.match(claim) or not path.startswith("/"):
            raise ConfigError("not CLAIM:PATH (a PersistentVolumeClaim and an absolute mount path)",
                              field="--volume", value=v, fix="use e.g. --volume shared-runs:/runs")
    if job.pvc and not CLAIM.match(job.pvc):
        raise ConfigError("not a PersistentVolumeClaim name (lower-case letters, digits, '-' and '.')",
                          field="--pvc", value=job.pvc, fix="give the name `kubectl get pvc` lists")
    if job.max_restarts > 0 and not _on_a_volume(job):
        raise ConfigError(f"{job.run_dir} is on the container's own disk, which a restarted pod gets back "
                          f"empty: each of the --max-requeues {job.max_restarts} restarts would train from step 0",
                          field="--run-dir", fix="mount a ReadWriteMany PersistentVolumeClaim there (--pvc CLAIM "
                          "with an absolute --run-dir, or --volume CLAIM:PATH with the run dir under PATH), or "
                          "use --max-requeues 0")


def _shell(job: K8sJob, nnodes: str, rank: str, addr: str, port: str) -> str:
    """`sh -c` text: the pod's shell fills in the node rank and master from its env."""
    q = " ".join
    if job.train:
        head = ["python", "-m", "tandem", "train", *job.command, "--launch.nproc_per_node", str(job.nproc_per_node),
                "--launch.simulate_nodes", "0", "--launch.run_dir", str(job.run_dir), "--stream"]
        tail = (f' --launch.nnodes "{nnodes}" --launch.node_rank "{rank}" --launch.master_addr "{addr}"'
                f' --launch.master_port "{port}"')
        return "exec " + q(shlex.quote(a) for a in head) + tail
    head = ["python", "-m", "tandem", "launch", "--nproc-per-node", str(job.nproc_per_node), "--run-dir",
            str(job.run_dir), "--cluster", "none"]
    tail = f' --nnodes "{nnodes}" --node-rank "{rank}" --master-addr "{addr}" --master-port "{port}" '
    return "exec " + q(shlex.quote(a) for a in head) + tail + q(shlex.quote(a) for a in job.command)


def _resources(job: K8sJob) -> dict:
    """Requests the scheduler places by; only GPUs are limited (a CPU limit throttles the data loaders, a
    memory limit turns a peak into an OOM kill, and an extended resource must have one)."""
    req = {"cpu": str(job.cpus_per_node or CPUS_PER_WORKER * job.nproc_per_node),
           "memory": job.memory or f"{GI_PER_WORKER * job.nproc_per_node}Gi"}
    if not job.gpus_per_node:
        return {"requests": req}
    gpu = {"nvidia.com/gpu": str(job.gpus_per_node)}
    return {"requests": {**req, **gpu}, "limits": gpu}


def _volumes(job: K8sJob) -> tuple[list[dict], list[dict]]:
    """(the pod's volumes, the container's mounts): the claims, and /dev/shm in memory."""
    vols = [{"name": n, "persistentVolumeClaim": {"claimName": c}} for n, c, _ in mounts(job)]
    mnts = [{"name": n, "mountPath": p} for n, _, p in mounts(job)]
    if job.shm_size not in ("", "0"):
        vols.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": job.shm_size}})
        mnts.append({"name": "dshm", "mountPath": "/dev/shm"})
    return vols, mnts


def _labels(job: K8sJob, queue: bool = False) -> dict:
    labels = {"app.kubernetes.io/name": "tandem", "tandem.dev/job": job.name}
    if queue and job.queue:  # Kueue admits the top-level object
        labels["kueue.x-k8s.io/queue-name"] = job.queue
    return labels


def _container(job: K8sJob, script: str, env: list[dict]) -> dict:
    c = {"name": "tandem", "image": job.image, "command": ["/bin/sh", "-c", script],
         "env": env + [{"name": k, "value": v} for k, v in sorted(job.env.items())],
         "ports": [{"containerPort": PORT, "name": "rendezvous", "protocol": "TCP"}]}
    c["resources"] = _resources(job)
    vols, mnts = _volumes(job)
    if mnts:
        c["volumeMounts"] = mnts
    return c


def _indexed_job_spec(job: K8sJob, addr: str, subdomain: str | None) -> dict:
    rank_env = [{"name": "NODE_RANK", "valueFrom": {"fieldRef": {
        "fieldPath": f"metadata.annotations['{INDEX_ANNOTATION}']"}}}]
    script = _shell(job, str(job.nodes), "$NODE_RANK", addr, str(PORT))
    pod = {"restartPolicy": "Never", "terminationGracePeriodSeconds": job.grace_s,
           "containers": [_container(job, script, rank_env)]}
    vols, _ = _volumes(job)
    if vols:
        pod["volumes"] = vols
    if subdomain:
        pod["subdomain"] = subdomain
    return {"completionMode": "Indexed", "completions": job.nodes, "parallelism": job.nodes,
            "backoffLimit": job.max_restarts if subdomain else 0,
            "template": {"metadata": {"labels": _labels(job)}, "spec": pod}}


def manifests(job: K8sJob) -> list[dict]:
    """The objects to apply, in order."""
    check(job)
    meta = {"name": job.name, "namespace": job.namespace, "labels": _labels(job, queue=True)}
    if job.kind == "jobset":
        # JobSet names pods <jobset>-<replicatedJob>-<job index>-<pod index>, in a subdomain named after it
        spec = {"network": {"enableDNSHostnames": True},
                "failurePolicy": {"maxRestarts": job.max_restarts},
                "replicatedJobs": [{"name": "node", "replicas": 1, "template": {
                    "spec": _indexed_job_spec(job, f"{job.name}-node-0-0.{job.name}", None)}}]}
        return [{"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": meta, "spec": spec}]
    if job.kind == "trainjob":
        script = _shell(job, "$PET_NNODES", "$PET_NODE_RANK", "$PET_MASTER_ADDR", "$PET_MASTER_PORT")
        trainer = {"image": job.image, "command": ["/bin/sh", "-c", script], "numNodes": job.nodes,
                   "numProcPerNode": job.nproc_per_node}
        if job.env:
            trainer["env"] = [{"name": k, "value": v} for k, v in sorted(job.env.items())]
        trainer["resourcesPerNode"] = _resources(job)
        spec = {"runtimeRef": {"name": "torch-distributed"}, "trainer": trainer,
                "runtimePatches": [_trainjob_patch(job)]}
        return [{"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob", "metadata": meta, "spec": spec}]
    service = {"apiVersion": "v1", "kind": "Service", "metadata": meta,
               "spec": {"clusterIP": "None", "selector": {"tandem.dev/job": job.name},
                        "ports": [{"name": "rendezvous", "port": PORT, "protocol": "TCP"}]}}
    # an indexed Job's pod i is named <job>-<i>, and <job>-<i>.<subdomain> resolves through the headless Service
    jobm = {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta,
            "spec": _indexed_job_spec(job, f"{job.name}-0.{job.name}", job.name)}
    return [service, jobm]


def _trainjob_patch(job: K8sJob) -> dict:
    """The pod settings a TrainJob's trainer has no field for, patched into the torch-distributed runtime's
    `node` job and container: the grace period, the volumes and their mounts."""
    vols, mnts = _volumes(job)
    pod: dict = {"terminationGracePeriodSeconds": job.grace_s}
    if vols:
        pod |= {"volumes": vols, "containers": [{"name": "node", "volumeMounts": mnts}]}
    node = {"name": "node", "template": {"spec": {"template": {"spec": pod}}}}
    return {"manager": PATCH_MANAGER, "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [node]}}}}


def render(job: K8sJob) -> str:
    import yaml

    return "".join("---\n" + yaml.safe_dump(m, sort_keys=False) for m in manifests(job))
