"""`tandem submit --on k8s` manifests: valid against Kubeflow's published models, and the pod command works.

No Kubernetes cluster can run here (no container runtime); what is checked instead:
every object round-trips through kubeflow-trainer-api's pydantic models with no key dropped
(a misspelt or misplaced field would be), the rendezvous names agree with the DNS names
JobSet / an indexed Job give pod 0, and the pod's own shell command, run here twice with the
env a node would get, forms one 4-rank job.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.core.errors import ConfigError
from tandem.submit.k8s_manifests import INDEX_ANNOTATION, K8sJob, manifests
from tandem.launch.launcher import free_port
from tandem_testing import ROOT, tandem_in_process


def job(**kw) -> K8sJob:
    base = dict(run_dir=Path("/runs/k"), command=["examples/hello_dist.py", "--x", "1"], nodes=2, nproc_per_node=2,
                name="hello", image="reg/me/train:1", gpus_per_node=4, queue="team-a", max_restarts=3,
                pvc="team-runs")
    return K8sJob(**{**base, **kw})


def _model(kind: str):
    models = pytest.importorskip("kubeflow_trainer_api.models") if os.environ.get("CI") != "true" else \
        __import__("kubeflow_trainer_api.models", fromlist=["x"])
    return {"JobSet": models.JobsetV1alpha2JobSet, "TrainJob": models.TrainerV1alpha1TrainJob,
            "Job": models.IoK8sApiBatchV1Job, "Service": models.IoK8sApiCoreV1Service}[kind]


@pytest.mark.parametrize("kind", ["jobset", "trainjob", "indexed"])
@pytest.mark.parametrize("extra", [{}, {"pvc": "", "volumes": ("shared:/runs", "data:/data"), "shm_size": "0",
                                        "memory": "64Gi", "cpus_per_node": 12, "gpus_per_node": 0}],
                         ids=["pvc+shm", "volumes,no-shm,requests"])
def test_manifests_round_trip_through_kubeflow_models(kind, extra):
    for m in manifests(job(kind=kind, **extra)):
        parsed = _model(m["kind"]).from_dict(m)
        assert parsed.to_dict() == m, f"{m['kind']}: the model dropped or changed keys"


def _container(job_spec: dict) -> dict:
    return job_spec["template"]["spec"]["containers"][0]


def test_jobset_rendezvous_on_pod_zero_and_restarts_the_group():
    (js,) = manifests(job())
    assert js["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert js["spec"]["failurePolicy"]["maxRestarts"] == 3 and js["spec"]["network"]["enableDNSHostnames"]
    rj = js["spec"]["replicatedJobs"][0]
    spec = rj["template"]["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"], spec["backoffLimit"]) == \
        ("Indexed", 2, 2, 0)
    c = _container(spec)
    # JobSet's pod 0 is <jobset>-<replicated job>-0-0 in the subdomain <jobset>
    assert f'--master-addr "hello-{rj["name"]}-0-0.hello"' in c["command"][2]
    assert c["env"][0]["valueFrom"]["fieldRef"]["fieldPath"] == f"metadata.annotations['{INDEX_ANNOTATION}']"
    assert c["resources"]["limits"] == {"nvidia.com/gpu": "4"}
    assert spec["template"]["spec"]["terminationGracePeriodSeconds"] == 120


def _pod_volumes(m: dict) -> tuple[list[dict], list[dict]]:
    """(the pod's volumes, the container's mounts) of any kind's manifest."""
    if m["kind"] == "TrainJob":
        (patch,) = m["spec"]["runtimePatches"]
        (node,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
        pod = node["template"]["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        assert (node["name"], c["name"]) == ("node", "node")  # the torch-distributed runtime's job and container
        return pod["volumes"], c["volumeMounts"]
    spec = m["spec"]["replicatedJobs"][0]["template"]["spec"] if m["kind"] == "JobSet" else m["spec"]
    return spec["template"]["spec"]["volumes"], _container(spec)["volumeMounts"]


@pytest.mark.parametrize("kind", ["jobset", "trainjob", "indexed"])
def test_run_dir_on_the_claim_and_shm_in_memory(kind):
    """A restarted pod finds the checkpoints (the claim is at the run dir) and DataLoader workers get more than
    the runtime's 64 MB /dev/shm."""
    vols, mnts = _pod_volumes(manifests(job(kind=kind))[-1])
    assert {v["name"] for v in vols} == {m["name"] for m in mnts}  # every mount names a volume of the pod
    by_path = {m["mountPath"]: next(v for v in vols if v["name"] == m["name"]) for m in mnts}
    assert by_path["/runs/k"]["persistentVolumeClaim"] == {"claimName": "team-runs"}
    assert by_path["/dev/shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    vols, mnts = _pod_volumes(manifests(job(kind=kind, shm_size="32Gi", pvc="", volumes=("shared:/runs",)))[-1])
    assert [(m["mountPath"], v.get("persistentVolumeClaim") or v["emptyDir"]) for m, v in zip(mnts, vols)] == \
        [("/runs", {"claimName": "shared"}), ("/dev/shm", {"medium": "Memory", "sizeLimit": "32Gi"})]


def test_requests_default_per_worker_and_only_gpus_are_limited():
    def res(**kw):
        (js,) = manifests(job(**kw))
        return _container(js["spec"]["replicatedJobs"][0]["template"]["spec"])["resources"]

    assert res(nproc_per_node=4, gpus_per_node=4) == {
        "requests": {"cpu": "8", "memory": "32Gi", "nvidia.com/gpu": "4"}, "limits": {"nvidia.com/gpu": "4"}}
    assert res(cpus_per_node=12, memory="100Gi", gpus_per_node=0) == {"requests": {"cpu": "12", "memory": "100Gi"}}
    (tj,) = manifests(job(kind="trainjob", nproc_per_node=1, gpus_per_node=0))
    assert tj["spec"]["trainer"]["resourcesPerNode"] == {"requests": {"cpu": "2", "memory": "8Gi"}}


REFUSED = [
    (dict(pvc=""), "--run-dir: /runs/k is on the container's own disk, which a restarted pod gets back empty: "
                   "each of the --max-requeues 3 restarts would train from step 0. Fix: mount a ReadWriteMany "
                   "PersistentVolumeClaim there (--pvc CLAIM with an absolute --run-dir, or --volume CLAIM:PATH with "
                   "the run dir under PATH), or use --max-requeues 0"),
    (dict(pvc="", volumes=("shared:/data",)), "--run-dir: /runs/k is on the container's own disk"),
    (dict(run_dir=Path("runs/k")), "--run-dir: a volume mounts at an absolute path in the pod (got 'runs/k'). Fix: "
                                   "give --pvc team-runs an absolute --run-dir, e.g. --run-dir /runs/k"),
    (dict(volumes=("shared",)), "--volume: not CLAIM:PATH"),
    (dict(volumes=("shared:runs",)), "--volume: not CLAIM:PATH"),
    (dict(pvc="Team_Runs"), "--pvc: not a PersistentVolumeClaim name"),
    (dict(shm_size="8GB"), "--shm-size: not a Kubernetes quantity (got '8GB'). Fix: use e.g. 64Gi or 512Mi"),
    (dict(memory="lots"), "--memory: not a Kubernetes quantity"),
]


@pytest.mark.parametrize("kw,line", REFUSED, ids=[",".join(k) for k, _ in REFUSED])
def test_volumes_and_sizes_are_checked(kw, line):
    with pytest.raises(ConfigError) as e:
        manifests(job(**kw))
    assert str(e.value).startswith(line), str(e.value)
    assert "\n" not in str(e.value)


def test_restarts_without_a_volume_refused_before_anything_is_written(tmp_path, capsys, monkeypatch):
    args = ["submit", "--on", "k8s", "--image", "x", "--max-requeues", "2", "--run-dir", str(tmp_path / "r"),
            "examples/hello_dist.py"]
    code, out, err = tandem_in_process(args, capsys, monkeypatch)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"error: --run-dir: {tmp_path / 'r'} is on the container's own disk"), err
    assert not (tmp_path / "r").exists()
    code, out, err = tandem_in_process(["submit", "--on", "k8s", "--image", "x", "--max-requeues", "2", "--run-dir",
                                        "/runs/a", "--pvc", "runs", "--dry-run", "examples/hello_dist.py"],
                                       capsys, monkeypatch)
    assert code == 0 and "claimName: runs" in out and "mountPath: /dev/shm" in out, err


def test_help_lists_the_kinds_the_code_takes(capsys, monkeypatch):
    from tandem.submit.k8s_manifests import KINDS

    code, out, _ = tandem_in_process(["submit", "--help"], capsys, monkeypatch)
    flat = " ".join(out.split())
    assert code == 0 and "pytorchjob" not in flat, out
    assert all(k in flat for k in KINDS), out
    for flag in ("--pvc", "--volume", "--shm-size", "--memory"):
        assert flag in flat, out


def test_indexed_job_and_headless_service_agree():
    svc, jb = manifests(job(kind="indexed"))
    assert svc["spec"]["clusterIP"] == "None"
    pod = jb["spec"]["template"]
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert pod["spec"]["subdomain"] == svc["metadata"]["name"]
    assert '--master-addr "hello-0.hello"' in _container(jb["spec"])["command"][2]  # pod <job>-<index>


def test_bad_input_is_one_line(tmp_path, capsys, monkeypatch):
    with pytest.raises(ConfigError, match="--image: a container image is needed"):
        manifests(job(image=""))
    with pytest.raises(ConfigError, match="--job-name: not a valid Kubernetes name"):
        manifests(job(name="My_Job"))
    code, _, err = tandem_in_process(["submit", "--on", "k8s", "--kind", "pytorchjob", "--image", "x",
                                      "examples/hello_dist.py"], capsys, monkeypatch)
    assert code == 2 and err.startswith("error: --kind: 'pytorchjob' is not one of jobset, trainjob, indexed"), err
    code, _, err = tandem_in_process(["submit", "--on", "k8s", "--image", "x", "--run-dir", str(tmp_path / "r"),
                                      "examples/hello_dist.py"], capsys, monkeypatch, path=str(tmp_path))
    assert code == 2 and err.startswith("error: --on: kubectl is not on PATH"), err
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_trainjob_pod_command_forms_one_job_from_pet_env(tmp_path):
    """The TrainJob's command, run as two pods would run it (PET_* from Trainer's torch runtime): one job."""
    (tj,) = manifests(job(kind="trainjob", run_dir=tmp_path / "run", command=["examples/hello_dist.py"],
                          nproc_per_node=1))
    cmd = tj["spec"]["trainer"]["command"]
    port = free_port()
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}", "PET_NNODES": "2",
           "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(port), "COLUMNS": "200"}
    procs = [subprocess.Popen(cmd, env={**env, "PET_NODE_RANK": str(k)}, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for k in (0, 1)]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    lines = [ln for out in outs for ln in out.splitlines() if "all_reduce sum" in ln]
    assert sorted(ln.split("]:", 1)[-1].split()[1] for ln in lines) == ["0/2", "1/2"], outs
    assert all("sum 1 (expect 1)" in ln for ln in lines), outs
    assert sorted(p.name for p in (tmp_path / "run" / "logs").glob("rank-?.log")) == ["rank-0.log", "rank-1.log"]


PET_ENV = {"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "train-node-0-0.train",
           "PET_MASTER_PORT": "29400", "PET_NPROC_PER_NODE": "4"}


def test_launch_takes_kubeflow_pet_env_unless_flags_say_otherwise():
    from tandem.core.spec import LaunchSpec
    from tandem.launch.cluster_env import from_cluster

    got = from_cluster(LaunchSpec(), PET_ENV)
    assert (got.nproc_per_node, got.nnodes, got.node_rank, got.master_addr, got.master_port) == \
        (4, "2", 1, "train-node-0-0.train", 29400)
    assert from_cluster(LaunchSpec(nproc_per_node=2), {**PET_ENV, "PET_NPROC_PER_NODE": "auto"}).nproc_per_node == 2
    mine = LaunchSpec(nnodes="3", node_rank=2, master_addr="h", master_port=1234)
    assert from_cluster(mine, PET_ENV) == mine
    one = from_cluster(LaunchSpec(), {**PET_ENV, "PET_NNODES": "1", "PET_NODE_RANK": "0"})
    assert one == LaunchSpec(nproc_per_node=4)  # one pod: keep the standalone store on a free port


def test_a_partial_pet_env_is_one_line(tmp_path, capsys, monkeypatch):
    for k in ("PET_NNODES", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"):
        monkeypatch.setenv(k, PET_ENV[k])
    monkeypatch.delenv("PET_MASTER_ADDR")
    code, _, err = tandem_in_process(["launch", "--run-dir", str(tmp_path / "r"), "examples/hello_dist.py"], capsys,
                                     monkeypatch)
    assert code == 2 and err.strip() == ("error: PET_MASTER_ADDR: PET_MASTER_ADDR is not set while PET_NNODES is. "
                                         "Fix: set PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT "
                                         "together (Kubeflow Trainer does), or unset PET_NNODES"), err
    monkeypatch.setenv("PET_MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("PET_NNODES", "1:2")
    code, _, err = tandem_in_process(["launch", "--run-dir", str(tmp_path / "r"), "examples/hello_dist.py"], capsys,
                                     monkeypatch)
    assert code == 2 and err.startswith("error: PET_NNODES: not an integer (got '1:2')."), err
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_plain_launch_under_pet_env_forms_one_rendezvous_of_two_nodes(tmp_path):
    """`tandem launch SCRIPT`, no placement flags, in two "pods" on this machine with the PET_* env Kubeflow
    Trainer's torch runtime sets (node ranks 0 and 1): one job of 2 nodes x PET_NPROC_PER_NODE workers."""
    env = {**os.environ, "PET_NNODES": "2", "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(free_port()),
           "PET_NPROC_PER_NODE": "1", "COLUMNS": "200"}
    procs = [subprocess.Popen([sys.executable, "-m", "tandem", "launch", "--run-dir", str(tmp_path / f"pod{k}"),
                               "examples/hello_dist.py"], env={**env, "PET_NODE_RANK": str(k)}, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for k in (0, 1)]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    lines = [ln.split("]:", 1)[-1] for out in outs for ln in out.splitlines() if "all_reduce sum" in ln]
    assert sorted(lines) == ["rank 0/2 node 0 local_rank 0 all_reduce sum 1 (expect 1)",
                             "rank 1/2 node 1 local_rank 0 all_reduce sum 1 (expect 1)"], outs
